"""The ragged paged attention written as directly as possible, in plain jnp: the oracle every other implementation
(the Pallas kernels here, `jaxserve.model.attention.ragged_attention`) is checked against, and the "dense" attention
backend (slow, but differentiable: what training needs).

Arrays in, arrays out: it knows the ragged batch layout (`RaggedRows`) and the paged cache (`read_pages`), nothing of
the model.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages, read_pages


def ragged_attention_reference(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None):
    """Causal grouped-query attention of each token over its row's cached keys and the step's own keys.

    q:       [T, num_heads, head_dim]  new queries (already rotated)
    k, v:    [T, kv_heads, head_dim]   this step's keys/values, not yet in the cache
    k_pages: [num_pages, kv_heads, page_size, head_dim'] (or Int8Pages)  the cache before this step (head_dim'
             >= head_dim: stored padded, `jaxserve.cache.kv_cache`)
    rows:    positions [T] (-1: padding), token_row [T], cached_lens [S], page_table [S, P]
    returns  [T, num_heads, head_dim]; padding tokens give zeros
    """
    T, H, D = q.shape
    _, KVH, page_size, _ = k_pages.shape
    L = rows.page_table.shape[1] * page_size
    pos, row = rows.positions, rows.token_row

    def gather(pages):  # every token's row's cache: [T, L, kv_heads, head_dim]
        dtype = q.dtype if isinstance(pages, Int8Pages) else jnp.float32  # float pages: read as the float32 used
        return read_pages(pages, rows.page_table[row], dtype, D).reshape(T, L, KVH, D).astype(jnp.float32)

    keys = jnp.concatenate([gather(k_pages), jnp.broadcast_to(k.astype(jnp.float32), (T, T, KVH, D))], axis=1)
    values = jnp.concatenate([gather(v_pages), jnp.broadcast_to(v.astype(jnp.float32), (T, T, KVH, D))], axis=1)
    cached_pos = jnp.broadcast_to(jnp.arange(L), (T, L))
    visible = jnp.concatenate([cached_pos < rows.cached_lens[row][:, None],
                               (row[None, :] == row[:, None]) & (pos[None, :] >= 0) & (pos[None, :] <= pos[:, None])],
                              axis=1)  # [T, L + T]
    key_pos = jnp.concatenate([cached_pos, jnp.broadcast_to(pos, (T, T))], axis=1)
    if sliding_window is not None:
        visible &= key_pos > pos[:, None] - sliding_window
    visible &= (pos >= 0)[:, None]
    s = jnp.einsum("tkgd,tlkd->tkgl", q.reshape(T, KVH, H // KVH, D).astype(jnp.float32), keys) * D ** -0.5
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("tkgl,tlkd->tkgd", p / jnp.where(l > 0, l, 1.0), values)
    return out.reshape(T, H, D).astype(q.dtype)


def lora_delta_reference(x, a, b, slot):
    """The multi-LoRA term, directly: each token's adapter gathered whole, float32 throughout.

    x [T, in]; a [N, in, R]; b [N, R, out] (scaling folded in); slot [T] int32 (-1: no adapter)
    returns [T, out] in x's dtype: row t = (x[t] @ a[slot[t]]) @ b[slot[t]], exactly 0 where slot[t] < 0
    """
    mine = slot >= 0
    index = jnp.where(mine, slot, 0)
    f32 = jnp.float32
    h = jnp.einsum("ti,tir->tr", x.astype(f32), a[index].astype(f32), precision="highest")  # [T, R]
    out = jnp.einsum("tr,tro->to", h, b[index].astype(f32), precision="highest")  # [T, out]
    return jnp.where(mine[:, None], out, 0.0).astype(x.dtype)
