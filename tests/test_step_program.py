"""What a plain step's compiled program runs every step: its top level (ENTRY), as opposed to the branches and loops
that run only when a row asks for them (top logprobs, prompt logprobs, sampling filters)."""
import re

from jaxserve.batching.batch_builder import Row, build_batch
from jaxserve.buckets import round_up
from tiny import make_llm


# A top-k over the vocabulary as XLA:CPU compiles it: a sort, or its TopK call (which it sorts with at small sizes).
TOP_K = re.compile(r' sort\(|custom_call_target="TopK"')


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


def test_batch1_decode_sorts_nothing_unasked(tiny_dir):
    """A one-token step (batch-1 decode) that asks for no logprobs sorts no vocabulary at its top level: the top
    logprobs' top-k lives in branches that run only when a row or a prompt token asks. (The prompt scorer's block
    was hoisted out of its loop at one token: a log-softmax and a sort of the vocabulary every batch-1 step.)"""
    llm = make_llm(tiny_dir)
    hlo = step_program(llm, [Row([5], 8, [1, 2, 3], slot=0, chained=True)])
    assert TOP_K.search(hlo), "the top-k is not where this test looks for it"
    assert not TOP_K.search(entry(hlo)), f"the step sorts the vocabulary at its top level:\n{entry(hlo)}"
