"""Attention over the paged KV cache: the one entry point the model calls, and its plain `jax.numpy` versions.

`attention` picks the implementation by backend, resolved once (`resolve_attention_backend`): "reference" is
`paged_attention` below (blocked jnp, the CPU path); "pallas" runs the Pallas kernels (paged attention over the
cached pages, flash attention over the step's own keys, merged by log-sum-exp). `paged_attention_reference` is the
same function written as directly as possible: the oracle for every other implementation in the tests.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve import pallas_kernels as pk
from jaxserve.cache.kv_cache import read_pages, write_pages

BACKENDS = ("auto", "reference", "pallas", "pallas-gpu", "pallas-tpu")


def resolve_attention_backend(name: str, platform: str | None = None) -> str:
    """auto | reference | pallas | pallas-gpu | pallas-tpu -> what runs: "reference", "pallas-gpu", "pallas-tpu",
    or on CPU "pallas-gpu-interpret" / "pallas-tpu-interpret" (the kernels interpreted: correct, slow)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.devices()[0].platform
    if name == "auto":
        return "pallas-" + platform if platform in ("gpu", "tpu") else "reference"
    if name == "reference":
        return name
    if name == "pallas":
        name = "pallas-" + (platform if platform in ("gpu", "tpu") else "gpu")
    if platform == "cpu":
        return name + "-interpret"
    if name != "pallas-" + platform:
        raise ValueError(f"attention_backend {name!r} cannot run on {platform}")
    return name


def attention(q, k, v, k_pages, v_pages, page_table, positions, *, sliding_window=None, backend="reference"):
    """Same arguments and result as `paged_attention_reference`, by the resolved backend."""
    if backend == "reference":
        return paged_attention(q, k, v, k_pages, v_pages, page_table, positions, sliding_window=sliding_window)
    paged, flash = pk.kernels_for(backend)
    start = positions[:, 0]  # [S]: cached keys of a row are exactly those before its first new token
    num_new = (positions >= 0).sum(axis=1)
    cached, cached_lse = paged(q, k_pages, v_pages, page_table, start, positions, sliding_window=sliding_window)
    new, new_lse = flash(q, k.astype(q.dtype), v.astype(q.dtype), start, start, num_new, num_new,
                         sliding_window=sliding_window)
    return pk.merge_attention(cached, cached_lse, new, new_lse)[0].astype(q.dtype)


# Finite, so a row with nothing to attend to (a padding row) softmaxes to a harmless uniform instead of NaN.
_MASKED = -1e30


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter new keys/values into their cache slots.

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] (or Int8Pages: quantized as they are written)
    k, v:             [S, Q, kv_heads, head_dim]
    slot_mapping:     [S, Q] flat slot (page * page_size + offset); padding tokens point into the scratch page 0.
    """
    flat = slot_mapping.reshape(-1)
    return (write_pages(k_pages, k.reshape(-1, *k.shape[2:]), flat),
            write_pages(v_pages, v.reshape(-1, *v.shape[2:]), flat))


def paged_attention_reference(q, k, v, k_pages, v_pages, page_table, positions, *, sliding_window=None):
    """Causal grouped-query attention of this step's queries over each sequence's cached pages and its new keys.

    q:          [S, Q, num_heads, head_dim]  new queries (already rotated), Q tokens per sequence row
    k, v:       [S, Q, kv_heads, head_dim]   this step's keys/values, not yet in the cache
    k_pages:    [num_pages, page_size, kv_heads, head_dim]  the cache before this step
    page_table: [S, P] pages of each sequence, in order; cached key j of a row sits at position j
    positions:  [S, Q] position of each query (-1: padding); a row's new tokens are contiguous, so the cache holds
                exactly the keys before positions[:, 0] and nothing beyond it is ever read
    returns     [S, Q, num_heads, head_dim]

    The cache is read before this step writes to it: on XLA:CPU a read after the in-place write forces a copy
    of the whole cache array every layer.
    """
    S, Q, H, D = q.shape
    _, page_size, KVH, _ = k_pages.shape
    L = page_table.shape[1] * page_size
    cached_k = read_pages(k_pages, page_table, q.dtype).reshape(S, L, KVH, D)  # [S, L, kv_heads, head_dim]
    cached_v = read_pages(v_pages, page_table, q.dtype).reshape(S, L, KVH, D)
    keys = jnp.concatenate([cached_k, k.astype(cached_k.dtype)], axis=1)  # [S, L + Q, kv_heads, head_dim]
    values = jnp.concatenate([cached_v, v.astype(cached_v.dtype)], axis=1)
    key_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(L), (S, L)), positions], axis=1)  # [S, L + Q]
    start = positions[:, :1]  # [S, 1]
    is_cached = jnp.arange(L + Q)[None, :] < L
    valid = jnp.where(is_cached, key_pos < start, key_pos >= 0)  # [S, L + Q]
    visible = valid[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None])  # [S, Q, L + Q]
    if sliding_window is not None:
        visible &= key_pos[:, None, :] > positions[:, :, None] - sliding_window
    # Group query heads by the KV head they share, so K/V are never repeated.
    q = q.reshape(S, Q, KVH, H // KVH, D)
    scores = jnp.einsum("sqkgd,slkd->sqkgl", q, keys, preferred_element_type=jnp.float32) * (D ** -0.5)
    scores = jnp.where(visible[:, :, None, None], scores, _MASKED)  # [S, Q, kv_heads, group, L + Q]
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("sqkgl,slkd->sqkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(S, Q, H, D).astype(q.dtype)


def paged_attention(q, k, v, k_pages, v_pages, page_table, positions, *, sliding_window=None, block_pages=8):
    """`paged_attention_reference` computed block by block over the cached pages, with an online softmax.

    Same arguments and result. Only the blocks holding cached tokens of the longest row are visited (a dynamic
    trip count), and no block larger than `block_pages` pages is ever materialised, so a step reads each
    cached K/V about once instead of gathering a whole padded page table (which dominated batched decode on
    XLA:CPU).
    """
    S, Q, H, D = q.shape
    _, page_size, KVH, _ = k_pages.shape
    block = block_pages * page_size
    num_blocks = -(-page_table.shape[1] // block_pages)
    page_table = jnp.pad(page_table, ((0, 0), (0, num_blocks * block_pages - page_table.shape[1])))
    q = q.reshape(S, Q, KVH, H // KVH, D) * (D ** -0.5)
    start = positions[:, :1]  # [S, 1]: the row's cached tokens are exactly those before its first new one

    def masked_scores(keys, key_pos, visible):
        s = jnp.einsum("sqkgd,slkd->sqkgl", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        if sliding_window is not None:
            visible &= key_pos[:, None, :] > positions[:, :, None] - sliding_window
        return jnp.where(visible[:, :, None, None], s, _MASKED)  # [S, Q, kv_heads, group, keys]

    def accumulate(carry, s, values):
        m, l, acc = carry
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jnp.einsum("sqkgl,slkd->sqkgd", p.astype(values.dtype), values,
                                                 preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc

    # This step's own keys first: every real query sees at least itself, so the running max starts finite.
    new_visible = (positions[:, None, :] >= 0) & (positions[:, None, :] <= positions[:, :, None])  # [S, Q, Q]
    s = masked_scores(k, positions, new_visible)
    init = (jnp.full(s.shape[:-1], _MASKED, jnp.float32), jnp.zeros(s.shape[:-1], jnp.float32),
            jnp.zeros((S, Q, KVH, H // KVH, D), jnp.float32))
    carry = accumulate(init, s, v)

    def visit_block(i, carry):
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * block_pages, block_pages, axis=1)  # [S, block_pages]
        keys = read_pages(k_pages, pages, q.dtype).reshape(S, block, KVH, D)
        values = read_pages(v_pages, pages, q.dtype).reshape(S, block, KVH, D)
        key_pos = jnp.broadcast_to(i * block + jnp.arange(block), (S, block))
        return accumulate(carry, masked_scores(keys, key_pos, (key_pos < start)[:, None, :]), values)

    blocks_used = jnp.minimum(-(-jnp.max(start) // block), num_blocks)
    _, l, acc = jax.lax.fori_loop(0, blocks_used, visit_block, carry)
    return (acc / l[..., None]).reshape(S, Q, H, D).astype(v.dtype)
