"""Paged attention (decode and verification): each sequence's queries attend to its K/V through its page table.

The kernel is written for the GPU (Pallas' Triton lowering): one program per (sequence, KV head) holds every query
row of that sequence for the query heads sharing the KV head (GQA without repeating K/V), and walks the
sequence's pages a block at a time with an online softmax, gathering each block of pages through the page table.
It visits only the blocks below the sequence's length (a dynamic trip count), so ragged lengths cost what they
hold. Several query tokens per sequence are causal among themselves when their keys are already in the pages
(speculative verification); with keys not yet written (jaxserve's steps) every query sees all `kv_lens` keys.
Mosaic GPU is where JAX's GPU Pallas is going (the Triton lowering is deprecated in 0.11), but its kernels are
written per warpgroup with explicit async copies; a gather of pages chosen at run time is direct in Triton, so
this kernel stays there until Mosaic GPU has an equivalent. int8 pages (`Int8Pages`: values and a float32 scale
per token and KV head) go in as two inputs each and are dequantized to the queries' dtype as they are loaded,
exactly as `read_pages` does, so the rest of the kernel is the same. Returns the log-sum-exp beside the output, so
partial attentions (cached pages here, the step's own keys in flash_attention) merge exactly (see `merge_attention`).

Every kernel has its `jax.numpy` reference beside it: the oracle in the tests (which run the kernel in Pallas
interpret mode on CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.cache.kv_cache import Int8Pages, read_pages

MASKED = -1e30  # finite: a row that sees nothing stays NaN-free


def dot_t(a, b):
    """a @ b.T accumulated in float32: [m, d] x [n, d] -> [m, n]. Operands stay in their dtype (bf16 on tensor
    cores / the MXU; a float32 dot would run multi-pass or without tensor cores)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
    """a @ b accumulated in float32, operands in b's dtype."""
    return jax.lax.dot_general(a.astype(b.dtype), b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def scores(q, k, scale, soft_cap):
    """Scaled (and soft-capped) q @ k.T in float32: [rows, D] x [keys, D] -> [rows, keys]."""
    s = dot_t(q, k.astype(q.dtype)) * scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def softmax_init(rows: int, head_dim: int):
    """An empty running softmax: max, sum [rows, 1] and weighted values [rows, D], float32."""
    return (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def softmax_block(m, l, acc, s, visible, v):
    """Adds one block of keys (scores s [rows, keys], values v [keys, D]) to a running softmax."""
    s = jnp.where(visible, s, MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # not exp(s - m): a row that saw nothing would sum to 1
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(axis=-1, keepdims=True), acc * corr + dot(p, v)


def softmax_result(m, l, acc):
    """(out [rows, D], lse [rows, 1]); a row that saw nothing gets 0 and MASKED, never NaN."""
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    return acc / safe, jnp.where(seen, m + jnp.log(safe), MASKED)


def split_pages(pages):
    """(values, scale): an Int8Pages' two arrays, or a float page array and None."""
    return (pages.values, pages.scale) if isinstance(pages, Int8Pages) else (pages, None)


def dequantize(values, scale, dtype):
    """Loaded page values in dtype; int8 ones times their scale (broadcastable: [..., 1]), as `read_pages` does."""
    values = values.astype(dtype)
    return values if scale is None else values * scale.astype(dtype)


def poisoned(out_shape, first_input: int):
    """Tests only: NaN buffers aliased to the outputs (inputs first_input, ...), so any element a kernel skips shows."""
    return ([jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape],
            {first_input + i: i for i in range(len(out_shape))})


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _paged_kernel(kv_len_ref, q_pos_ref, table_ref, q_ref, k_ref, v_ref, *refs, page_size, block_pages,
                  sliding_window, soft_cap, scale, quantized):
    o_ref, lse_ref = refs[-2:]  # (with `poison`, the aliased output buffers come before them, unread)
    k_scale_ref, v_scale_ref = refs[:2] if quantized else (None, None)
    # q_ref [rows, D]; q_pos_ref [rows]; table_ref [pages_per_seq]; k_ref, v_ref [num_pages, page_size, D]
    # (int8 when quantized, with k_scale_ref, v_scale_ref [num_pages, page_size] float32)
    rows, head_dim = q_ref.shape
    block = block_pages * page_size
    q = q_ref[...]
    q_pos = q_pos_ref[...]
    kv_len = kv_len_ref[0, 0]

    def visit(i, carry):
        pages = table_ref[pl.ds(i * block_pages, block_pages)]
        k = k_ref[pages].reshape(block, head_dim)  # [block, D]: a gather through the page table
        v = v_ref[pages].reshape(block, head_dim)
        if quantized:  # the scales gathered alike, [block, 1]
            k = dequantize(k, k_scale_ref[pages].reshape(block, 1), q.dtype)
            v = dequantize(v, v_scale_ref[pages].reshape(block, 1), q.dtype)
        key_pos = i * block + jnp.arange(block)[None, :]
        visible = (key_pos < kv_len) & (key_pos <= q_pos[:, None])
        if sliding_window is not None:
            visible &= key_pos > q_pos[:, None] - sliding_window
        return softmax_block(*carry, scores(q, k, scale, soft_cap), visible, v.astype(q.dtype))

    num_blocks = jnp.minimum(pl.cdiv(kv_len, block), table_ref.shape[0] // block_pages)
    first_block = 0
    if sliding_window is not None:  # blocks wholly before every query's window are skipped
        lowest = jnp.min(jnp.where(q_pos >= 0, q_pos, 2 ** 30))
        first_block = jnp.minimum(jnp.maximum(lowest - sliding_window + 1, 0) // block, num_blocks)
    out, lse = softmax_result(*jax.lax.fori_loop(first_block, num_blocks, visit, softmax_init(rows, head_dim)))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "block_pages", "max_rows", "interpret",
                                             "poison"))
def paged_attention(q, k_pages, v_pages, page_table, kv_lens, q_positions, *, sliding_window=None, soft_cap=None,
                    block_pages=8, max_rows=64, interpret=False, poison=False):
    """q [S, Q, H, D]; k_pages, v_pages [num_pages, page_size, KVH, D] (or Int8Pages); page_table [S, P]; kv_lens
    [S] (keys at positions < kv_lens[s] are in the pages); q_positions [S, Q] (-1: padding, sees nothing).

    Returns (out [S, Q, H, D] in q's dtype, lse [S, Q, H] float32; MASKED where a query saw no key).
    poison: tests only, the outputs start as NaN (aliased) so any element the kernel skips shows.
    """
    S, Q, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    G = H // KVH
    # A program takes a block of its sequence's query rows (all of them for decode; a prefill chunk is split, so
    # registers hold the accumulator). Power-of-two blocks for the GPU lowering, >= 16 rows for the dots.
    block_rows = min(_pow2(Q * G, 16), max_rows)
    rows = -(-Q * G // block_rows) * block_rows
    block_pages = min(block_pages, _pow2(page_table.shape[1]))
    P = _pow2(page_table.shape[1], block_pages)
    # [S, KVH, Q * G, D]: a program's rows are its sequence's queries for the heads sharing one KV head.
    q_rows = q.reshape(S, Q, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(S, KVH, Q * G, D)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - Q * G), (0, 0)))
    pos_rows = jnp.pad(jnp.repeat(q_positions, G, axis=1), ((0, 0), (0, rows - Q * G)), constant_values=-1)
    table = jnp.pad(page_table, ((0, 0), (0, P - page_table.shape[1])))
    (k_values, k_scale), (v_values, v_scale) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scale is not None
    scales = [k_scale, v_scale] if quantized else []
    kernel = functools.partial(_paged_kernel, page_size=page_size, block_pages=block_pages,
                               sliding_window=sliding_window, soft_cap=soft_cap, scale=D ** -0.5, quantized=quantized)
    out_shape = [jax.ShapeDtypeStruct((S, KVH, rows, D), q.dtype), jax.ShapeDtypeStruct((S, KVH, rows), jnp.float32)]
    extra, aliases = poisoned(out_shape, 6 + len(scales)) if poison else ([], {})
    o, lse = pl.pallas_call(
        kernel,
        grid=(S, KVH, rows // block_rows),
        in_specs=[
            pl.BlockSpec((1, 1), lambda s, h, r: (s, 0)),  # kv_lens
            pl.BlockSpec((None, block_rows), lambda s, h, r: (s, r)),  # query positions
            pl.BlockSpec((None, P), lambda s, h, r: (s, 0)),  # page table row
            pl.BlockSpec((None, None, block_rows, D), lambda s, h, r: (s, h, r, 0)),  # queries
            pl.BlockSpec((num_pages, page_size, None, D), lambda s, h, r: (0, 0, h, 0)),  # K pages of this head
            pl.BlockSpec((num_pages, page_size, None, D), lambda s, h, r: (0, 0, h, 0)),  # V pages of this head
        ] + [pl.BlockSpec((num_pages, page_size, None), lambda s, h, r: (0, 0, h))] * len(scales)  # their scales
        + [pl.BlockSpec(memory_space=pl.ANY)] * len(extra),
        out_specs=[pl.BlockSpec((None, None, block_rows, D), lambda s, h, r: (s, h, r, 0)),
                   pl.BlockSpec((None, None, block_rows), lambda s, h, r: (s, h, r))],
        out_shape=out_shape,
        input_output_aliases=aliases,
        # Triton explicitly: JAX now lowers GPU Pallas to Mosaic GPU unless told otherwise.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_attention",
    )(kv_lens.reshape(S, 1).astype(jnp.int32), pos_rows.astype(jnp.int32), table.astype(jnp.int32), q_rows,
      k_values, v_values, *scales, *extra)
    o = o[:, :, :Q * G].reshape(S, KVH, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(S, Q, H, D)
    lse = lse[:, :, :Q * G].reshape(S, KVH, Q, G).transpose(0, 2, 1, 3).reshape(S, Q, H)
    return o, lse


def paged_attention_reference(q, k_pages, v_pages, page_table, kv_lens, q_positions, *, sliding_window=None,
                              soft_cap=None):
    """The same function, directly: gather every page of the table, mask, softmax. Int8 pages are dequantized to
    q's dtype (as the kernels do), float pages are read as they are."""
    S, Q, H, D = q.shape
    _, page_size, KVH, _ = k_pages.shape
    L = page_table.shape[1] * page_size

    def gather(pages):
        dtype = q.dtype if isinstance(pages, Int8Pages) else pages.dtype
        return read_pages(pages, page_table, dtype).reshape(S, L, KVH, D).astype(jnp.float32)

    k, v = gather(k_pages), gather(v_pages)
    q32 = q.reshape(S, Q, KVH, H // KVH, D).astype(jnp.float32)
    s = jnp.einsum("sqkgd,slkd->sqkgl", q32, k) * D ** -0.5
    s = s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(L)[None, None, :]
    visible = (key_pos < kv_lens[:, None, None]) & (key_pos <= q_positions[:, :, None])  # [S, Q, L]
    if sliding_window is not None:
        visible &= key_pos > q_positions[:, :, None] - sliding_window
    return masked_softmax_attention(s, visible[:, :, None, None, :], v, (S, Q, H, D), q.dtype)


def masked_softmax_attention(scores, visible, v, out_shape, dtype):
    """softmax(scores) @ v over visible keys, and the log-sum-exp; rows that see nothing give 0 and MASKED.

    scores [S, Q, KVH, G, L] float32; visible broadcastable to it; v [S, L, KVH, D].
    """
    scores = jnp.where(visible, scores, -jnp.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    l = p.sum(axis=-1)
    out = jnp.einsum("sqkgl,slkd->sqkgd", p, v) / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), MASKED)
    S, Q, H, D = out_shape
    return out.reshape(S, Q, H, D).astype(dtype), lse.reshape(S, Q, H)


def merge_attention(o1, lse1, o2, lse2):
    """Attention over two disjoint key sets, from each one's output and log-sum-exp (float32 math)."""
    m = jnp.maximum(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - m)[..., None], jnp.exp(lse2 - m)[..., None]
    out = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    return out.astype(o1.dtype), m + jnp.log(w1[..., 0] + w2[..., 0])
