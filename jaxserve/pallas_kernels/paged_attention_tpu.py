"""Paged attention for TPU (Pallas Mosaic): same contract as `paged_attention.paged_attention`.

TPU Pallas moves blocks with BlockSpecs, and an index map may read scalars prefetched into SMEM: here the page
table. The grid is (sequence, block of query rows, page); each step's K/V block is one whole page with all KV heads
side by side in the lanes ([page_size, kv_heads * head_dim], a free reshape of the cache), fetched straight from the
page the table names, and an online softmax accumulates in VMEM scratch across the page axis. Pages past a
sequence's length are neither fetched (the index map repeats the last real page, so the pipeline skips the copy)
nor computed. int8 pages (`Int8Pages`) come as int8 values in the same layout plus each page's float32 scales,
[page_size, kv_heads] (whole last two dims of the scale array, so any kv_heads tiles), fetched by the same index
map; each head's keys and values are dequantized to the queries' dtype as they are loaded.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.paged_attention import (MASKED, dequantize, scores, softmax_block, softmax_result,
                                                     split_pages)


def reset_softmax(m_sc, l_sc, acc_sc) -> None:
    """Empties a running softmax kept in VMEM scratch across a sequential grid axis."""
    m_sc[...] = jnp.full(m_sc.shape, MASKED, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def write_softmax(o_ref, lse_ref, m_sc, l_sc, acc_sc) -> None:
    out, lse = softmax_result(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _paged_tpu_kernel(lens_ref, table_ref, q_pos_ref, q_ref, k_ref, v_ref, *refs, page_size, sliding_window,
                      soft_cap, scale, quantized):
    # q_pos_ref [rows, 1]; q_ref [KVH, rows, D]; k_ref, v_ref [page_size, KVH * D]; scratch [KVH, rows, 1 | D]
    # (quantized: k_ref, v_ref int8, then k_scale_ref, v_scale_ref [page_size, KVH] float32)
    k_scale_ref, v_scale_ref = refs[:2] if quantized else (None, None)
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[-5:]
    s, p = pl.program_id(0), pl.program_id(2)
    kvh, _, head_dim = q_ref.shape

    pl.when(p == 0)(lambda: reset_softmax(m_sc, l_sc, acc_sc))

    kv_len = lens_ref[s]

    @pl.when(p * page_size < kv_len)
    def _visit():
        q_pos = q_pos_ref[...]  # [rows, 1]
        key_pos = p * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        visible = (key_pos < kv_len) & (key_pos <= q_pos)
        if sliding_window is not None:
            visible &= key_pos > q_pos - sliding_window
        dtype = q_ref.dtype
        for h in range(kvh):  # static: each KV head with the query rows that share it
            heads = slice(h * head_dim, (h + 1) * head_dim)
            k_scale, v_scale = (k_scale_ref[:, h:h + 1], v_scale_ref[:, h:h + 1]) if quantized else (None, None)
            k = dequantize(k_ref[:, heads], k_scale, dtype)  # [page_size, D]
            v = dequantize(v_ref[:, heads], v_scale, dtype)
            m, l, acc = softmax_block(m_sc[h], l_sc[h], acc_sc[h], scores(q_ref[h], k, scale, soft_cap), visible, v)
            m_sc[h], l_sc[h], acc_sc[h] = m, l, acc

    pl.when(p == pl.num_programs(2) - 1)(lambda: write_softmax(o_ref, lse_ref, m_sc, l_sc, acc_sc))


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "max_rows", "interpret"))
def paged_attention_tpu(q, k_pages, v_pages, page_table, kv_lens, q_positions, *, sliding_window=None,
                        soft_cap=None, max_rows=128, interpret=False):
    """Arguments and result as `paged_attention.paged_attention` (q [S, Q, H, D] -> out, lse [S, Q, H])."""
    S, Q, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    G = H // KVH
    P = page_table.shape[1]
    block_rows = min(-(-Q * G // 8) * 8, max_rows)  # a sublane multiple; a prefill chunk is split into blocks
    rows = -(-Q * G // block_rows) * block_rows
    q_rows = q.reshape(S, Q, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(S, KVH, Q * G, D)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - Q * G), (0, 0)))
    pos_rows = jnp.pad(jnp.repeat(q_positions, G, axis=1), ((0, 0), (0, rows - Q * G)), constant_values=-1)
    kv_lens = kv_lens.astype(jnp.int32)

    def page_index(s, r, p, lens, table):
        last = jnp.maximum(pl.cdiv(lens[s], page_size) - 1, 0)
        return table[s * P + jnp.minimum(p, last)]

    (k_values, k_scale), (v_values, v_scale) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scale is not None
    scales = [k_scale, v_scale] if quantized else []
    kernel = functools.partial(_paged_tpu_kernel, page_size=page_size, sliding_window=sliding_window,
                               soft_cap=soft_cap, scale=D ** -0.5, quantized=quantized)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # kv_lens [S], page table [S * P]
        grid=(S, rows // block_rows, P),
        in_specs=[
            pl.BlockSpec((None, block_rows, 1), lambda s, r, p, *_: (s, r, 0)),  # query positions, one per sublane
            pl.BlockSpec((None, KVH, block_rows, D), lambda s, r, p, *_: (s, 0, r, 0)),
            pl.BlockSpec((None, page_size, KVH * D), lambda *a: (page_index(*a), 0, 0)),
            pl.BlockSpec((None, page_size, KVH * D), lambda *a: (page_index(*a), 0, 0)),
        ] + [pl.BlockSpec((None, page_size, KVH), lambda *a: (page_index(*a), 0, 0))] * len(scales),
        out_specs=[pl.BlockSpec((None, KVH, block_rows, D), lambda s, r, p, *_: (s, 0, r, 0)),
                   pl.BlockSpec((None, KVH, block_rows, 1), lambda s, r, p, *_: (s, 0, r, 0))],
        scratch_shapes=[pltpu.VMEM((KVH, block_rows, 1), jnp.float32), pltpu.VMEM((KVH, block_rows, 1), jnp.float32),
                        pltpu.VMEM((KVH, block_rows, D), jnp.float32)],
    )
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((S, KVH, rows, D), q.dtype),
                   jax.ShapeDtypeStruct((S, KVH, rows, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_tpu",
    )(kv_lens, page_table.reshape(-1).astype(jnp.int32), pos_rows.astype(jnp.int32)[:, :, None], q_rows,
      k_values.reshape(num_pages, page_size, KVH * D), v_values.reshape(num_pages, page_size, KVH * D), *scales)
    o = o[:, :, :Q * G].reshape(S, KVH, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(S, Q, H, D)
    lse = lse[:, :, :Q * G, 0].reshape(S, KVH, Q, G).transpose(0, 2, 1, 3).reshape(S, Q, H)
    return o, lse
