"""The ragged attention (reference and the blocked CPU path) against plain dense causal attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.kv_cache import BF16_BITS, Int8Pages, read_blocks, read_head_major, take_tiles_by_page
from jaxserve.model.attention import (
    attention,
    blocked_attention,
    ragged_attention,
    ragged_attention_reference,
    write_kv,
)

from ragged import KINDS, expected, random_ragged_case, row_lengths


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size, heads, kv_heads, window", [(1, 4, 4, None), (4, 6, 2, None), (16, 8, 1, None),
                                                                (4, 6, 3, 5)])
def test_matches_dense_attention(kind, page_size, heads, kv_heads, window):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    case = random_ragged_case(rng, row_lengths(rng, kind), page_size=page_size, heads=heads, kv_heads=kv_heads)
    want = expected(case, window)
    for fn in (ragged_attention_reference, ragged_attention, blocked_attention):
        got = np.asarray(fn(case.q, case.k, case.v, jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
                                   case.rows, sliding_window=window))
        assert np.isfinite(got).all(), f"seed {seed}"
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=f"{fn.__name__}, seed {seed}")


def test_the_dense_backend_is_the_oracle():
    """attention_backend "dense": the oracle itself (what training differentiates), through the model's entry point."""
    rng = np.random.default_rng(0)
    case = random_ragged_case(rng, row_lengths(rng, "mixed"), page_size=4, heads=6, kv_heads=2)
    args = (case.q, case.k, case.v, jnp.asarray(case.k_pages), jnp.asarray(case.v_pages), case.rows)
    np.testing.assert_array_equal(np.asarray(attention(*args, sliding_window=5, backend="dense")),
                                  np.asarray(ragged_attention_reference(*args, sliding_window=5)))


def test_long_row_and_sorted_groups():
    """A long prompt chunk after a long cache (the one-pass path) beside decode rows and fresh chunks."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    lengths = [(200, 1), (37, 1), (150, 30), (0, 12), (90, 6), (5, 1)]
    case = random_ragged_case(rng, lengths, page_size=4, pad_tokens=3)
    got = np.asarray(ragged_attention(case.q, case.k, case.v, jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
                                      case.rows, block_pages=4, num_groups=3, long_row_share=4, small_step=8,
                                      own_block=16))
    np.testing.assert_allclose(got, expected(case), rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("stored", ["float32", "int8", "bf16 bits"])
def test_read_blocks_is_each_head_of_its_pages_in_order(stored):
    """read_blocks: head h of pages p0, p1, ... back to back, whatever the pages hold (the gather by (page, head)
    tiles must pick the same keys as reading the pages as stored)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    shape = (9, 3, 4, 8)  # [num_pages, kv_heads, page_size, head_dim]
    values = rng.standard_normal(shape).astype(np.float32)
    if stored == "int8":
        pages = Int8Pages(jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
                          jnp.asarray(rng.random(shape[:-1]), jnp.float32))
    elif stored == "bf16 bits":
        pages = jax.lax.bitcast_convert_type(jnp.asarray(values, jnp.bfloat16), BF16_BITS)
    else:
        pages = jnp.asarray(values)
    ids = jnp.asarray(rng.integers(0, shape[0], (2, 5, 3)), jnp.int32)  # [tokens, ..., block_pages]
    got = np.asarray(read_blocks(pages, ids, jnp.float32, 6))  # [2, 5, kv_heads, 3 * page_size, 6]
    as_stored = np.asarray(read_head_major(pages, ids, jnp.float32, 6))  # [2, 5, 3, kv_heads, page_size, 6]
    want = as_stored.transpose(0, 1, 3, 2, 4, 5).reshape(2, 5, 3, 3 * 4, 6)
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    if stored == "float32":  # the gather other platforms take (TPU: no flat view of the pages)
        np.testing.assert_array_equal(np.asarray(take_tiles_by_page(pages, ids))[..., :6], want, err_msg=f"seed {seed}")


def test_write_puts_new_tokens_in_their_slots_only():
    rng = np.random.default_rng(0)
    case = random_ragged_case(rng, [(10, 3), (0, 5), (7, 1)], page_size=4)
    slots = case.batch.slot_mapping
    k_after, _ = write_kv(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages), case.k, case.v, slots)
    def by_slot(pages):  # [num_pages, KVH, page_size, D] -> [slots, KVH, D]
        return np.swapaxes(np.asarray(pages), 1, 2).reshape(-1, *case.k.shape[1:])
    k_after = by_slot(k_after)
    real = case.rows.positions >= 0
    np.testing.assert_array_equal(k_after[slots[real]], case.k[real])
    page_size = case.k_pages.shape[2]
    untouched = np.setdiff1d(np.arange(page_size, case.k_pages.shape[0] * page_size), slots)  # page 0: scratch
    np.testing.assert_array_equal(k_after[untouched], by_slot(case.k_pages)[untouched])
