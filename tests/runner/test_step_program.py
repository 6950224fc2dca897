"""What a plain step's compiled program runs every step: its top level (ENTRY), as opposed to the branches and loops
that run only when a row asks for them (top logprobs, prompt logprobs, sampling filters); and how a step's inputs
reach it."""
import re

import jax
import numpy as np
import pytest

from jaxserve.batch import is_constant
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
from jaxserve.runner.placement import MAYBE_CONSTANT
from jaxserve.sample import token_mask

from programs import entry, step_program
from tiny import make_llm


def vocab_top_k(text: str, vocab_size: int) -> list[str]:
    """The lines of compiled text that run a top-k over the vocabulary, as XLA:CPU compiles one: its TopK call, or
    a sort of [..., V] (attention's argsort over the step's tokens is not one)."""
    return [line for line in text.split("\n") if 'custom_call_target="TopK"' in line
            or (" sort(" in line and re.search(rf"[\[,]{vocab_size}\]", line))]


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


def test_maybe_constant_fields_are_the_builders_constants():
    """Steps.put_batch passes the fields a batch may hold as a constant as device arrays, the others as numpy: the
    set it knows is the one the batch builder fills with constants."""
    batch = build_batch([Row([5], 0, [1])], 4, 320, 4, 2, 3)
    constants = {path[-1].name for path, x in jax.tree_util.tree_leaves_with_path(batch) if is_constant(x)}
    assert constants == MAYBE_CONSTANT


def test_a_field_in_use_adds_no_dispatch_entry(tiny_dir):
    """A batch whose rows use the fields that are constants elsewhere (a logit bias, penalties' history, a token
    mask, prompt targets) dispatches the plain batch's program entry: each argument is always of one kind."""
    llm = make_llm(tiny_dir)
    r = llm.runner
    r.fetch(r.dispatch([Row([5, 6], 0, [1])]))
    entries = r.steps._forward._cache_size()
    used = RowSampling(logit_bias=(np.array([3], np.int32), np.array([1.5], np.float32)), presence_penalty=0.5,
                       past_tokens=np.array([5, 6], np.int32), token_mask=token_mask.allowing([3, 4], 320),
                       bad_word_bans=((5, 7),))
    r.fetch(r.dispatch([Row([5, 6], 0, [1], used, prompt_targets=[6], score_from=0)]))
    assert r.steps._forward._cache_size() == entries


def cache_copies(hlo: str, pages_shape: tuple[int, ...]) -> list[str]:
    """The compiled program's copies of an array of the cache's pages' shape (a whole layer's K or V)."""
    shape = "[" + ",".join(map(str, pages_shape)) + "]"
    return [line for line in hlo.split("\n") if " copy(" in line and shape in line.split("=", 1)[-1][:60]]


@pytest.mark.parametrize("rows", [
    [Row([5], 8, [1, 2, 3], slot=0, chained=True)],
    [Row(list(range(9)), 0, [1, 2, 3], slot=0)],
], ids=["b1", "chunk9"])
def test_cpu_step_writes_its_cache_in_place_in_one_program(tiny_dir, rows):
    """On one CPU device the forward also writes the cache (jaxserve.runner.steps): its compiled program copies no
    layer's cache (a write XLA could order before a read would), and a step dispatches that one program, no `_write`."""
    llm = make_llm(tiny_dir)
    steps = llm.runner.steps
    assert steps.writes_in_forward
    pages = llm.runner.kv_cache[0][0].shape
    hlo = step_program(llm, rows)
    assert "dynamic-update-slice" in hlo or "scatter" in hlo, "the program does not write the cache"
    assert not cache_copies(hlo, pages), "\n".join(cache_copies(hlo, pages)[:4])
    writes = steps._write._cache_size()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert steps._write._cache_size() == writes


def test_the_cache_copies_counted_are_there_without_region_analysis(tiny_dir, monkeypatch):
    """What the test above counts is what XLA:CPU inserts when copy insertion does not follow the barrier: the same
    program compiled without the option copies the layers' caches."""
    import jaxserve.runner.steps as steps_module
    monkeypatch.setattr(steps_module, "IN_PLACE_WRITES", {})
    steps_module.steps_for.cache_clear()
    try:
        llm = make_llm(tiny_dir)
        hlo = step_program(llm, [Row([5], 8, [1, 2, 3], slot=0, chained=True)])
        assert cache_copies(hlo, llm.runner.kv_cache[0][0].shape)
    finally:
        steps_module.steps_for.cache_clear()


def test_a_step_s_memory_grows_with_its_page_table_not_with_tokens_times_context(tiny_dir):
    """A prompt chunk's program at page tables of 64 and 8192 pages (a 128K-token context at 16 tokens a page): its
    temporaries grow by a few [rows, width] arrays (the table itself, padded), not by anything [tokens, width] (each
    token's row of the table, gathered whole: 8 MB here, 64 MB a layer for a 2048-token chunk at 128K), nor by any
    [tokens, context] score. The context enters a step only through the table's width (chunked prefill bounds its
    tokens), so this is a prefill's memory staying flat in the prompt's length."""
    llm = make_llm(tiny_dir, max_num_batched_tokens=256)
    r = llm.runner
    rows = [Row(list(range(200)), 40, [1] * 60), Row([5], 100, [1] * 26)]  # a chunk after 40 cached, a decode row
    temp = {}
    for width in (64, 8192):
        batch = r.steps.put_batch(build_batch(rows, r.page_size, 320, 256, 4, width))
        compiled = r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, batch, None).compile()
        temp[width] = compiled.memory_analysis().temp_size_in_bytes
    table = 4 * (8192 - 64) * 4  # one [rows, width] int32 array's growth
    assert temp[8192] - temp[64] <= 8 * table, (temp, "a step's temporaries grew with tokens x table width")
