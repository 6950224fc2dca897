"""Attention over the paged KV cache: the one entry point the model calls.

The implementation here is the plain `jax.numpy` reference (the CPU path and the test oracle for the Pallas
kernels, which plug in behind `paged_attention` with the same arguments).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so a row with nothing to attend to (a padding row) softmaxes to a harmless uniform instead of NaN.
_MASKED = -1e30


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter new keys/values into their cache slots.

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    k, v:             [S, Q, kv_heads, head_dim]
    slot_mapping:     [S, Q] flat slot (page * page_size + offset); padding tokens point into the scratch page 0.
    """
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    flat = slot_mapping.reshape(-1)
    k_pages = k_pages.reshape(-1, kv_heads, head_dim).at[flat].set(k.reshape(-1, kv_heads, head_dim).astype(k_pages.dtype))
    v_pages = v_pages.reshape(-1, kv_heads, head_dim).at[flat].set(v.reshape(-1, kv_heads, head_dim).astype(v_pages.dtype))
    shape = (num_pages, page_size, kv_heads, head_dim)
    return k_pages.reshape(shape), v_pages.reshape(shape)


def paged_attention(q, k_pages, v_pages, page_table, positions, context_lens, *, sliding_window=None):
    """Causal grouped-query attention of new queries against each sequence's cached pages.

    q:            [S, Q, num_heads, head_dim]  new queries (already rotated), Q tokens per sequence row
    k_pages:      [num_pages, page_size, kv_heads, head_dim] (already holding this step's keys)
    page_table:   [S, P] pages of each sequence, in order; key j of a row sits at position j
    positions:    [S, Q] position of each query in its sequence
    context_lens: [S] tokens of each sequence in the cache (keys at j >= context_len are stale or foreign)
    returns       [S, Q, num_heads, head_dim]
    """
    S, Q, H, D = q.shape
    _, page_size, KVH, _ = k_pages.shape
    L = page_table.shape[1] * page_size
    k = k_pages[page_table].reshape(S, L, KVH, D)  # [S, L, kv_heads, head_dim]
    v = v_pages[page_table].reshape(S, L, KVH, D)
    # Group query heads by the KV head they share, so K/V are never repeated.
    q = q.reshape(S, Q, KVH, H // KVH, D)
    scores = jnp.einsum("sqkgd,slkd->skgql", q, k, preferred_element_type=jnp.float32) * (D ** -0.5)
    key_pos = jnp.arange(L)
    visible = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, _MASKED)  # [S, kv_heads, group, Q, L]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("skgql,slkd->sqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(S, Q, H, D).astype(q.dtype)
