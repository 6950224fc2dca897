"""Flash attention for TPU (Pallas Mosaic): same contract as `flash_attention.flash_attention`.

Heads move ahead of tokens ([B, H, T, D]), so a block is a (tokens, head_dim) tile. The grid is (sequence, query
head, query block, key block); the key axis is sequential and an online softmax accumulates in VMEM scratch. Key
blocks no query of the block can see (past the causal diagonal, before the sliding window, past the keys) are
neither computed nor fetched: the index map clamps them onto a block it already holds. Query heads read their
shared KV head through the index map, so K/V are never repeated. Sequence lengths and offsets are prefetched
scalars.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.paged_attention import scores, softmax_block
from jaxserve.pallas_kernels.paged_attention_tpu import reset_softmax, write_softmax


def _visible_blocks(b, i, lens, block_q, block_k, causal, sliding_window):
    """[lo, hi) key blocks that query block i of row b can see (hi > lo unless it sees nothing)."""
    q_start, k_start, q_len, k_len = lens[4 * b], lens[4 * b + 1], lens[4 * b + 2], lens[4 * b + 3]
    first = i * block_q
    last_q = q_start + jnp.minimum(first + block_q, q_len) - 1
    hi = pl.cdiv(jnp.minimum(k_len, last_q - k_start + 1), block_k) if causal else pl.cdiv(k_len, block_k)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(q_start + first - sliding_window + 1 - k_start, 0) // block_k
    return lo, hi


def _flash_tpu_kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, block_q, block_k,
                      causal, sliding_window, soft_cap, scale):
    # q_ref [block_q, D]; k_ref, v_ref [block_k, D]; scratch [block_q, 1 | D]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_start, k_start, q_len, k_len = lens_ref[4 * b], lens_ref[4 * b + 1], lens_ref[4 * b + 2], lens_ref[4 * b + 3]
    lo, hi = _visible_blocks(b, i, lens_ref, block_q, block_k, causal, sliding_window)

    pl.when(j == 0)(lambda: reset_softmax(m_sc, l_sc, acc_sc))

    @pl.when((j >= lo) & (j < hi))
    def _visit():
        q_idx = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        k_idx = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        q_pos, k_pos = q_start + q_idx, k_start + k_idx
        visible = (q_idx < q_len) & (k_idx < k_len)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        m, l, acc = softmax_block(m_sc[...], l_sc[...], acc_sc[...], scores(q_ref[...], k_ref[...], scale, soft_cap),
                                  visible, v_ref[...].astype(q_ref.dtype))
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    pl.when(j == pl.num_programs(3) - 1)(lambda: write_softmax(o_ref, lse_ref, m_sc, l_sc, acc_sc))


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "soft_cap", "block_q", "block_k",
                                             "interpret"))
def flash_attention_tpu(q, k, v, q_start, k_start, q_lens, k_lens, *, causal=True, sliding_window=None,
                        soft_cap=None, block_q=128, block_k=128, interpret=False):
    """Arguments and result as `flash_attention.flash_attention` (q [B, T, H, D] -> out, lse [B, T, H])."""
    B, T, H, D = q.shape
    _, L, KVH, _ = k.shape
    G = H // KVH
    block_q = min(block_q, -(-T // 8) * 8)
    block_k = min(block_k, -(-L // 8) * 8)
    Tp, Lp = -(-T // block_q) * block_q, -(-L // block_k) * block_k
    qh = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, H, Tp, D]
    kh = jnp.pad(k, ((0, 0), (0, Lp - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, KVH, Lp, D]
    vh = jnp.pad(v, ((0, 0), (0, Lp - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    lens = jnp.stack([q_start, k_start, q_lens, k_lens], axis=1).astype(jnp.int32).reshape(-1)

    def kv_index(b, h, i, j, lens):
        lo, hi = _visible_blocks(b, i, lens, block_q, block_k, causal, sliding_window)
        # Skipped blocks repeat a visible one (no fetch); never past the last block, even when nothing is visible.
        return b, h // G, jnp.minimum(jnp.clip(j, lo, jnp.maximum(hi - 1, lo)), Lp // block_k - 1), 0

    kernel = functools.partial(_flash_tpu_kernel, block_q=block_q, block_k=block_k, causal=causal,
                               sliding_window=sliding_window, soft_cap=soft_cap, scale=D ** -0.5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, H, Tp // block_q, Lp // block_k),
        in_specs=[pl.BlockSpec((None, None, block_q, D), lambda b, h, i, j, lens: (b, h, i, 0)),
                  pl.BlockSpec((None, None, block_k, D), kv_index),
                  pl.BlockSpec((None, None, block_k, D), kv_index)],
        out_specs=[pl.BlockSpec((None, None, block_q, D), lambda b, h, i, j, lens: (b, h, i, 0)),
                   pl.BlockSpec((None, None, block_q, 1), lambda b, h, i, j, lens: (b, h, i, 0))],
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                        pltpu.VMEM((block_q, D), jnp.float32)],
    )
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, D), q.dtype), jax.ShapeDtypeStruct((B, H, Tp, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="flash_attention_tpu",
    )(lens, qh, kh, vh)
    return o.transpose(0, 2, 1, 3)[:, :T], lse[..., 0].transpose(0, 2, 1)[:, :T]
