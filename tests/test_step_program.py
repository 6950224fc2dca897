"""What a plain step's compiled program runs every step: its top level (ENTRY), as opposed to the branches and loops
that run only when a row asks for them (top logprobs, prompt logprobs, sampling filters)."""
import re

import pytest

from jaxserve.batching.batch_builder import Row, build_batch
from jaxserve.buckets import round_up
from tiny import make_llm


def vocab_top_k(text: str, vocab_size: int) -> list[str]:
    """The lines of compiled text that run a top-k over the vocabulary, as XLA:CPU compiles one: its TopK call, or
    a sort of [..., V] (attention's argsort over the step's tokens is not one)."""
    return [line for line in text.split("\n") if 'custom_call_target="TopK"' in line
            or (" sort(" in line and re.search(rf"[\[,]{vocab_size}\]", line))]


def step_program(llm, rows: list[Row]) -> str:
    """The compiled text of the plain step's forward program over rows, as the runner would dispatch them."""
    r = llm.runner
    tokens = round_up(sum(len(row.token_ids) for row in rows), r.buckets.num_tokens)
    batch = r.steps.put_batch(build_batch(rows, r.page_size, r.config.vocab_size, tokens, r.buckets.num_rows(tokens),
                                          r.buckets.pages_per_row))
    return r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, batch, None).compile().as_text()


def entry(hlo: str) -> str:
    top = hlo[hlo.index("\nENTRY"):]
    return top[:top.index("\n}")]


@pytest.mark.parametrize("rows", [
    [Row([5], 8, [1, 2, 3], slot=0, chained=True)],  # batch-1 decode: one token
    [Row([5], 8, [1, 2, 3], slot=i, chained=True) for i in range(3)],  # three decode rows
    [Row(list(range(9)), 0, [1, 2, 3], slot=0)],  # a prompt chunk
], ids=["b1", "b3", "chunk9"])
def test_step_sorts_nothing_unasked(tiny_dir, rows):
    """A step that asks for no logprobs sorts no vocabulary at its top level: the top logprobs' top-k lives in
    branches that run only when a row or a prompt token asks. (The prompt scorer's block was hoisted out of its
    loop at one token: a log-softmax and a sort of the vocabulary every batch-1 decode step, ~9 ms of ~57.)"""
    llm = make_llm(tiny_dir)
    hlo = step_program(llm, rows)
    V = llm.config.vocab_size
    assert vocab_top_k(hlo, V), "the top-k is not where this test looks for it"
    assert not vocab_top_k(entry(hlo), V), f"the step sorts the vocabulary at its top level:\n{entry(hlo)}"
