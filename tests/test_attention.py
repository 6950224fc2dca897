"""The paged attention reference against plain dense causal attention on random inputs."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import paged_attention, paged_attention_reference, write_kv


def dense_attention(q, k, v, positions, window=None):
    """q: [Q, H, D] at `positions`; k, v: [T, KVH, D] for positions 0..T-1. Plain numpy, float64."""
    Q, H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((Q, H, D))
    for i, pos in enumerate(positions):
        keys = np.arange(pos + 1)
        if window is not None:
            keys = keys[keys > pos - window]
        for h in range(H):
            s = k[keys, h // group] @ q[i, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[keys, h // group]
    return out


@pytest.mark.parametrize("page_size, heads, kv_heads, window", [(1, 4, 4, None), (4, 6, 2, None), (16, 8, 1, None),
                                                                (4, 6, 3, 5)])
def test_matches_dense_attention(page_size, heads, kv_heads, window):
    rng = np.random.default_rng()
    D, num_pages = 16, 700
    # Two sequences in one batch: one mid-prompt chunk (cached prefix + several new tokens), one decoding.
    lengths = [(rng.integers(0, 300), rng.integers(2, 9)), (rng.integers(1, 300), 1)]  # several blocks of pages
    Q = max(n for _, n in lengths)
    k_pages = rng.normal(size=(num_pages, page_size, kv_heads, D)).astype(np.float32)  # stale data everywhere
    v_pages = rng.normal(size=(num_pages, page_size, kv_heads, D)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    P = max(-(-(start + n) // page_size) for start, n in lengths) + 1
    q = rng.normal(size=(2, Q, heads, D)).astype(np.float32)
    k_new = rng.normal(size=(2, Q, kv_heads, D)).astype(np.float32)
    v_new = rng.normal(size=(2, Q, kv_heads, D)).astype(np.float32)
    page_table = np.zeros((2, P), np.int32)
    positions = np.full((2, Q), -1, np.int32)
    slots = np.zeros((2, Q), np.int32)
    full = []
    for row, (start, n) in enumerate(lengths):
        pages = [free.pop() for _ in range(-(-(start + n) // page_size))]
        k_all = rng.normal(size=(start + n, kv_heads, D)).astype(np.float32)
        v_all = rng.normal(size=(start + n, kv_heads, D)).astype(np.float32)
        for t in range(start):  # the cached prefix, scattered over the sequence's pages
            k_pages[pages[t // page_size], t % page_size] = k_all[t]
            v_pages[pages[t // page_size], t % page_size] = v_all[t]
        k_all[start:] = k_new[row, :n]
        v_all[start:] = v_new[row, :n]
        page_table[row, :len(pages)] = pages
        positions[row, :n] = np.arange(start, start + n)
        slots[row, :n] = [pages[t // page_size] * page_size + t % page_size for t in range(start, start + n)]
        full.append((k_all, v_all))
    for attention in (paged_attention_reference, paged_attention):
        got = np.asarray(attention(q, k_new, v_new, jnp.asarray(k_pages), jnp.asarray(v_pages), page_table, positions,
                                   sliding_window=window))
        assert np.isfinite(got).all()
        for row, (start, n) in enumerate(lengths):
            want = dense_attention(q[row, :n], *full[row], positions[row, :n], window)
            np.testing.assert_allclose(got[row, :n], want, rtol=2e-4, atol=2e-5)
    # The write puts exactly the new tokens where the slots say and nothing else changes.
    k_after, _ = write_kv(jnp.asarray(k_pages), jnp.asarray(v_pages), k_new, v_new, slots)
    k_after = np.asarray(k_after).reshape(-1, kv_heads, D)
    for row, (start, n) in enumerate(lengths):
        np.testing.assert_array_equal(k_after[slots[row, :n]], k_new[row, :n])
    # (page 0 is the scratch page that padding writes into)
    untouched = np.setdiff1d(np.arange(page_size, num_pages * page_size), slots)
    np.testing.assert_array_equal(k_after[untouched], k_pages.reshape(-1, kv_heads, D)[untouched])
