"""Ragged paged attention for the GPU (Pallas' Triton lowering): same arguments and result as
`jaxserve.pallas_kernels.reference.ragged_attention_reference`.

Each row's new tokens are cut into query blocks of `block_q` tokens; a block never spans two rows, so a program of
the grid (query block, KV head) serves one row. Which row and which of its tokens a block holds is worked out in
the wrapper with jnp from `query_start` (no host round trip), over a static number of block slots (`num_slots`:
min(T, T // block_q + S) bounds the blocks of any split of T tokens into S rows); unused slots do no work. The
wrapper gathers each slot's queries so a program's inputs are plain blocks: its rows are its tokens' queries for
the query heads sharing its KV head (GQA without repeating K/V), padded to a power of two >= 16 for the dots. The
page table is not gathered: a program reads its row's entries of the whole [S, P] table in place, as many as it
walks (a per-slot copy was [slots, P] int32, 3 MB a call at 128K and 64 rows). A decode-only step (T <= S) packs
16 / G tokens a block, so a decode row is one program per KV head whose dot rows are its G query heads; block sizes
come from `gpu_blocks` (shared memory, registers).
When those programs are few against the chip's SMs (1-4 rows over 8 KV heads: 8-32 programs on 132 SMs) and the
page tables long, each row's cached keys are split over a third grid axis (flash-decoding, `key_splits`): split s
walks the s-th equal part of the row's own cached blocks and writes its partial softmax (output and log-sum-exp,
float32), merged after by `combine_splits` in jnp (programs x R x D floats: 1 MB for 128 decode programs at D 128).

A program folds into one online softmax first its row's cached keys, walking the row's pages `block_pages` at a
time through the page table (a dynamic trip count from `cached_lens`, so ragged lengths cost what they hold), then
the row's new keys (this step's k, v, not yet in the cache: read from the flat arrays at the row's offset, causal
by position), `block_k` at a time up to the block's last token. A sliding window skips the blocks before it. int8
pages (`Int8Pages`) go in as values and scales and are dequantized to the queries' dtype as they are loaded, as
`read_pages` does.

Mosaic GPU is where JAX's GPU Pallas is going (the Triton lowering is deprecated in 0.11), but its kernels are
written per warpgroup with explicit async copies; a gather of pages chosen at run time is direct in Triton, so this
kernel stays there until Mosaic GPU has an equivalent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.batch import RaggedRows
from jaxserve.pallas_kernels.gpu_blocks import HOPPER_CORES, HOPPER_SHARED_MEMORY, dot_rows, gpu_blocks, key_splits
from jaxserve.pallas_kernels.query_blocks import QueryBlocks, num_slots, query_blocks, unblock
from jaxserve.pallas_kernels.softmax import (
    dequantize,
    pad_head_dim,
    pow2,
    scores,
    softmax_block,
    softmax_init,
    softmax_result,
    split_pages,
)

_FAR = 2 ** 30  # a position past every real one: "no token here" in the block metadata
# Per block slot, in the order the kernel reads them: cached keys, first new token of the row (flat index), the
# row's new tokens, how many of them this block's queries can see, the lowest position among its queries, the row.
_CACHED, _ROW_START, _NUM_NEW, _OWN_END, _LOWEST, _ROW = range(6)


def _kernel(meta_ref, q_pos_ref, table_ref, q_ref, k_ref, v_ref, k_pos_ref, k_pages_ref, v_pages_ref, *refs,
            page_size, block_pages, block_k, sliding_window, scale, quantized, splits):
    # meta_ref [1, 8] (see _CACHED...); q_pos_ref [rows] (-1: no query); table_ref [S, P'] every row's (P' whole
    # blocks of block_pages: a program reads its row's, no [slots, P'] copy per step); q_ref [rows, D];
    # k_ref, v_ref [T + block_k, D] this step's keys of this KV head; k_pos_ref [T + block_k] their positions;
    # k_pages_ref, v_pages_ref [num_pages, page_size, D] of this KV head (int8 when quantized, then the scales
    # [num_pages, page_size] float32 follow); o_ref [rows, D]; split: then o_ref float32 and lse_ref [rows], this
    # split's part of the softmax (`combine_splits`)
    o_ref, lse_ref = refs[-2:] if splits > 1 else (refs[-1], None)
    k_scale_ref, v_scale_ref = refs[:2] if quantized else (None, None)
    rows, head_dim = q_ref.shape
    block = block_pages * page_size
    q = q_ref[...]
    q_pos = q_pos_ref[...][:, None]  # [rows, 1]
    cached, row_start, num_new = meta_ref[0, _CACHED], meta_ref[0, _ROW_START], meta_ref[0, _NUM_NEW]
    own_end, lowest, row = meta_ref[0, _OWN_END], meta_ref[0, _LOWEST], meta_ref[0, _ROW]
    window_start = 0 if sliding_window is None else jnp.maximum(lowest - sliding_window + 1, 0)

    def in_window(key_pos):
        return True if sliding_window is None else key_pos > q_pos - sliding_window

    def visit_cached(i, carry):
        pages = table_ref[row, pl.ds(i * block_pages, block_pages)]
        k = k_pages_ref[pages].reshape(block, head_dim)  # [block, D]: a gather through the page table
        v = v_pages_ref[pages].reshape(block, head_dim)
        if quantized:  # the scales gathered alike, [block, 1]
            k = dequantize(k, k_scale_ref[pages].reshape(block, 1), q.dtype)
            v = dequantize(v, v_scale_ref[pages].reshape(block, 1), q.dtype)
        key_pos = i * block + jnp.arange(block)[None, :]
        visible = (key_pos < cached) & in_window(key_pos)
        return softmax_block(*carry, scores(q, k, scale), visible, v.astype(q.dtype))

    def visit_new(i, carry):
        first = row_start + i * block_k
        k = k_ref[pl.ds(first, block_k), :]  # [block_k, D]
        v = v_ref[pl.ds(first, block_k), :]
        key_pos = k_pos_ref[pl.ds(first, block_k)][None, :]
        mine = (i * block_k + jnp.arange(block_k))[None, :] < num_new  # the rest belongs to the next rows
        visible = mine & (key_pos >= 0) & (key_pos <= q_pos) & in_window(key_pos)
        return softmax_block(*carry, scores(q, k, scale), visible, v.astype(q.dtype))

    num_blocks = jnp.minimum(pl.cdiv(cached, block), table_ref.shape[1] // block_pages)
    first = jnp.minimum(window_start // block, num_blocks)
    # This program's split of the row's visible cached blocks: equal parts of what the row holds (not of the
    # table), so a short row's keys spread too; the last split, often the shortest, also takes the new keys.
    split = pl.program_id(2) if splits > 1 else 0
    per_split = pl.cdiv(num_blocks - first, splits)
    lo = jnp.minimum(first + split * per_split, num_blocks)
    carry = softmax_init(rows, head_dim)
    carry = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, num_blocks), visit_cached, carry)
    # The new keys' blocks start at the row's first token; the window may skip some of them too.
    new_blocks = jnp.where(split == splits - 1, pl.cdiv(own_end, block_k), 0)
    first_new = jnp.minimum(jnp.maximum(window_start - cached, 0) // block_k, new_blocks)
    carry = jax.lax.fori_loop(first_new, new_blocks, visit_new, carry)
    out, lse = softmax_result(*carry)
    o_ref[...] = out.astype(o_ref.dtype)
    if splits > 1:
        lse_ref[...] = lse[:, 0]


def kernel_grid(num_tokens: int, num_rows: int, kv_heads: int, block_q: int, splits: int = 1) -> tuple[int, ...]:
    """The grid the kernel runs: (query block slots, KV heads), then splits of each row's cached keys if > 1."""
    return (num_slots(num_tokens, num_rows, block_q), kv_heads) + ((splits,) if splits > 1 else ())


def combine_splits(out, lse):
    """The splits' partial softmaxes, out [..., splits, R, D] (each normalised by its own sum) and lse
    [..., splits, R] (MASKED where a split saw nothing), merged -> [..., R, D]. A split that saw nothing weighs
    exp(MASKED - max) = 0; if none did, all weigh 1 and their zeros give 0, never NaN."""
    w = jnp.exp(lse - lse.max(axis=-2, keepdims=True))  # [..., splits, R]
    return (w[..., None] * out).sum(axis=-3) / w.sum(axis=-2)[..., None]


@functools.partial(jax.jit, static_argnames=("sliding_window", "block_q", "block_k", "block_pages", "num_warps",
                                             "num_stages", "shared_memory", "cores", "num_splits", "interpret"))
def ragged_attention_gpu(q, k, v, k_pages, v_pages, rows: RaggedRows, *, sliding_window=None, block_q=16,
                         block_k=None, block_pages=None, num_warps=None, num_stages=None,
                         shared_memory=HOPPER_SHARED_MEMORY, cores=HOPPER_CORES, num_splits=None, interpret=False):
    """Arguments and result as `ragged_attention_reference`: q [T, H, D], k, v [T, KVH, D], pages
    [num_pages, KVH, page_size, D'] (or Int8Pages; D' >= D, stored padded) -> [T, H, D]; padding tokens give zeros.

    Block sizes not given are derived by `gpu_blocks` from the shapes and `shared_memory` (bytes per block):
    block_q: new tokens of one row per program in steps with more tokens than rows (a step with T <= S, every
      decode-only one, packs 16 / G tokens: one program per row and KV head; see `step_block_q`);
    block_k: new keys per step of a program's walk over its row's new tokens (a power of two, >= 16 on GPU);
    block_pages: cached pages per step of the walk over its row's pages;
    num_warps, num_stages: Triton's;
    num_splits: programs sharing one row's cached keys (flash-decoding; their partial softmaxes merged after),
      by default `key_splits`: enough that the grid fills `cores` (the chip's SMs) when rows are few and the page
      table long, else 1.
    """
    T, H, head_dim = q.shape
    num_pages, KVH, page_size, D = k_pages.shape
    q, k, v = pad_head_dim(D, q, k, v)
    G = H // KVH
    S, P = rows.page_table.shape
    (k_values, k_scale), (v_values, v_scale) = split_pages(k_pages), split_pages(v_pages)
    derived = gpu_blocks(T, S, G, D, page_size, q.dtype.itemsize, shared_memory, block_q)
    block_q = derived.block_q
    block_k = block_k or derived.block_k
    block_pages = block_pages or derived.block_pages
    NB = num_slots(T, S, block_q)
    R = dot_rows(block_q, G)
    bp = min(block_pages, pow2(P))
    splits = num_splits or key_splits(NB * KVH, P, bp, cores)

    # Which row each block slot serves, and which of its tokens (see query_blocks).
    blocks = query_blocks(rows, T, block_q)
    meta, q_pos = _block_metadata(rows, blocks, block_q)
    q_rows, pos_rows = _query_rows(q, q_pos, blocks.token, KVH, R)
    table = rows.page_table.astype(jnp.int32)  # [S, P'] whole blocks of pages (a walk never reads past it)
    if P % bp:
        table = jnp.pad(table, ((0, 0), (0, bp - P % bp)))
    # The new keys padded by a block, so a walk's last block never reads past them.
    k_new, v_new = (jnp.pad(x, ((0, block_k), (0, 0), (0, 0))) for x in (k, v))
    k_pos = jnp.pad(rows.positions, (0, block_k), constant_values=-1)  # [T + block_k]
    quantized = k_scale is not None
    scales = [k_scale, v_scale] if quantized else []

    kernel = functools.partial(_kernel, page_size=page_size, block_pages=bp, block_k=block_k,
                               sliding_window=sliding_window, scale=head_dim ** -0.5, quantized=quantized,
                               splits=splits)
    out_specs, out_shape = _outputs(NB, KVH, splits, R, D, q.dtype)
    out = pl.pallas_call(
        kernel,
        grid=kernel_grid(T, S, KVH, block_q, splits),
        in_specs=_in_specs(R, D, table.shape, T + block_k, num_pages, page_size, len(scales)),
        out_specs=out_specs,
        out_shape=out_shape,
        # Triton explicitly: JAX now lowers GPU Pallas to Mosaic GPU unless told otherwise.
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or derived.num_warps,
                                                num_stages=num_stages or derived.num_stages),
        interpret=interpret,
        name="ragged_attention",
    )(meta, pos_rows.astype(jnp.int32), table, q_rows, k_new, v_new, k_pos.astype(jnp.int32),
      k_values, v_values, *scales)
    if splits > 1:
        out = combine_splits(*out).astype(q.dtype)  # [NB, KVH, R, D]

    # Back to the flat tokens: token t of row r sits in slot first_block[r] + local // block_q, at local % block_q.
    out = out[:, :, :block_q * G].reshape(NB, KVH, block_q, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * block_q, H, D)
    return unblock(out[..., :head_dim], blocks, rows, q.dtype)


def _block_metadata(rows: RaggedRows, blocks: QueryBlocks, block_q: int):
    """(meta [NB, 8] int32, the kernel's per-slot scalars (see _CACHED...); q_pos [NB, block_q], -1: no token)."""
    num_new, slot_row = blocks.num_new, blocks.block_row
    first_local = blocks.local[:, 0]  # [NB] the slot's first token within its row
    used = blocks.present[:, 0]  # slots past the last block: nothing to do
    q_pos = jnp.where(blocks.present, rows.positions[blocks.token], -1)  # [NB, block_q]
    meta = jnp.zeros((blocks.block_row.shape[0], 8), jnp.int32)
    meta = meta.at[:, _CACHED].set(jnp.where(used, rows.cached_lens[slot_row], 0))
    meta = meta.at[:, _ROW_START].set(blocks.query_start[slot_row])
    meta = meta.at[:, _NUM_NEW].set(jnp.where(used, num_new[slot_row], 0))
    meta = meta.at[:, _OWN_END].set(jnp.where(used, jnp.minimum(first_local + block_q, num_new[slot_row]), 0))
    meta = meta.at[:, _LOWEST].set(jnp.min(jnp.where(q_pos >= 0, q_pos, _FAR), axis=1))
    meta = meta.at[:, _ROW].set(slot_row)
    return meta, q_pos


def _query_rows(q, q_pos, token, kv_heads: int, R: int):
    """A slot's dot rows: its tokens' queries (token-major) for the heads of one KV head, q_rows [NB, KVH, R, D],
    and their positions pos_rows [NB, R] (-1 in the padding rows)."""
    T, H, D = q.shape
    G = H // kv_heads
    NB, block_q = token.shape
    q_rows = q.reshape(T, kv_heads, G, D)[token].transpose(0, 2, 1, 3, 4).reshape(NB, kv_heads, block_q * G, D)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, R - block_q * G), (0, 0)))
    pos_rows = jnp.pad(jnp.repeat(q_pos, G, axis=1), ((0, 0), (0, R - block_q * G)), constant_values=-1)
    return q_rows, pos_rows


def _in_specs(R: int, D: int, table: tuple[int, int], Tk: int, num_pages: int, page_size: int, num_scales: int):
    """The kernel's inputs per program (slot b, KV head h, split): the whole page table, Tk new keys."""
    return [
        pl.BlockSpec((1, 8), lambda b, h, *_: (b, 0)),  # block metadata
        pl.BlockSpec((None, R), lambda b, h, *_: (b, 0)),  # query positions
        pl.BlockSpec(table, lambda b, h, *_: (0, 0)),  # the page table (the program's row read through meta)
        pl.BlockSpec((None, None, R, D), lambda b, h, *_: (b, h, 0, 0)),  # queries
        pl.BlockSpec((Tk, None, D), lambda b, h, *_: (0, h, 0)),  # this step's keys of this head
        pl.BlockSpec((Tk, None, D), lambda b, h, *_: (0, h, 0)),  # and values
        pl.BlockSpec((Tk,), lambda b, h, *_: (0,)),  # their positions
        pl.BlockSpec((num_pages, None, page_size, D), lambda b, h, *_: (0, h, 0, 0)),  # K pages of this head
        pl.BlockSpec((num_pages, None, page_size, D), lambda b, h, *_: (0, h, 0, 0)),  # V pages of this head
    ] + [pl.BlockSpec((num_pages, None, page_size), lambda b, h, *_: (0, h, 0))] * num_scales  # their scales


def _outputs(NB: int, KVH: int, splits: int, R: int, D: int, dtype):
    """(out_specs, out_shape): [NB, KVH, R, D] in dtype, or with splits each split's part of the softmax, float32
    until merged: out [NB, KVH, splits, R, D] and lse [NB, KVH, splits, R]."""
    if splits > 1:
        return ([pl.BlockSpec((None, None, None, R, D), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
                [jax.ShapeDtypeStruct((NB, KVH, splits, R, D), jnp.float32),
                 jax.ShapeDtypeStruct((NB, KVH, splits, R), jnp.float32)])
    return (pl.BlockSpec((None, None, R, D), lambda b, h: (b, h, 0, 0)),
            jax.ShapeDtypeStruct((NB, KVH, R, D), dtype))
