"""A step's LM head and sampler run over the rows that sample, at the smallest of steps.HEAD_ROWS that holds them,
not over every padded row of its bucket (`Steps._sample_used_rows`)."""
import numpy as np
import pytest

from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
from jaxserve.runner.steps import HEAD_ROWS

from tiny import make_llm


@pytest.fixture(scope="module")
def wide_llm(tiny_dir):
    # A 64-token step has min(64, max_num_seqs) = 32 rows.
    return make_llm(tiny_dir, max_num_seqs=32, max_num_batched_tokens=64)


def rows_of(lengths, rng, vocab_size):
    """Prompt rows of these lengths back to back, each on its own pages, each sampling greedily with logprobs."""
    rows, page = [], 1
    for n in lengths:
        pages = list(range(page, page + -(-n // 4)))
        page += len(pages)
        rows.append(Row(rng.integers(0, vocab_size, n).tolist(), 0, pages,
                        RowSampling(temperature=0.0, want_top_logprobs=True), slot=len(rows)))
    return rows


@pytest.mark.parametrize("lengths", [[40], [30, 3, 2, 5, 6, 1], [3] * 20], ids=["1 row", "6 rows", "20 rows"])
def test_step_samples_its_rows_as_the_full_head_does(wide_llm, lengths):
    """Each row's greedy token, its logprob and its top logprobs are the log-softmax of the model's own logits at
    the row's last token, whichever branch (4, 16 or all 32 rows) the step's head ran at."""
    seed = sum(lengths)
    r = wide_llm.runner
    V = r.config.vocab_size
    rows = rows_of(lengths, np.random.default_rng(seed), V)
    batch = build_batch(rows, r.page_size, V, 64, r.buckets.num_rows(64), r.buckets.pages_per_row)
    assert batch.logits_index.shape[0] == 32 > HEAD_ROWS[-1]
    logits, r.kv_cache = r.steps.forward_logits(r.params, r.kv_cache, batch)
    out, r.kv_cache, r.last_tokens = r.steps.step(r.params, r.kv_cache, r.last_tokens, batch)
    logits = np.asarray(logits, np.float64)
    last = np.cumsum(lengths) - 1
    ref = logits[last] - np.log(np.exp(logits[last] - logits[last].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits[last].max(-1, keepdims=True)  # [rows, V] log-softmax
    k = len(rows)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:k, 0], ref.argmax(-1), err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(out.logprobs)[:k, 0], ref.max(-1), atol=1e-4, err_msg=f"seed {seed}")
    top = np.asarray(out.top_logprobs)[:k, 0]  # [rows, MAX_LOGPROBS]
    np.testing.assert_allclose(top, -np.sort(-ref, axis=-1)[:, :top.shape[-1]], atol=1e-4, err_msg=f"seed {seed}")


def test_the_step_program_holds_a_head_at_each_row_count(wide_llm):
    """The 64-token step's program multiplies the head at 4, 16 and 32 rows (one branch runs)."""
    r = wide_llm.runner
    V = r.config.vocab_size
    batch = r.steps.put_batch(build_batch(rows_of([40], np.random.default_rng(0), V), r.page_size, V, 64,
                                          r.buckets.num_rows(64), r.buckets.pages_per_row))
    hlo = r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, batch, None).compile().as_text()
    dots = [line for line in hlo.split("\n") if " dot(" in line or "custom-call" in line and "matmul" in line]
    for rows in (4, 16, 32):
        assert any(f"f32[{rows},{V}]" in line for line in dots), f"no [{rows}, {V}] head product"
