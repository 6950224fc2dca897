"""Flash attention (prefill): causal, grouped-query attention over contiguous K/V, never forming the score matrix.

One program per (sequence, query head, block of queries) walks the key blocks with an online softmax, and only the
blocks its queries can see: up to the causal diagonal, and from the sliding window's start. Queries sit at
positions q_start + i and keys at k_start + j, so a query chunk can start after the keys do (chunked prefill over
a contiguous prefix); lengths need not be block multiples (q_lens, k_lens mask the tail). Query heads index their
shared KV head in the BlockSpec, so K/V are never repeated. Written for Pallas' Triton lowering (see
paged_attention.py for why not Mosaic GPU yet); returns the log-sum-exp for `merge_attention`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.pallas_kernels.paged_attention import (masked_softmax_attention, poisoned, scores, softmax_block,
                                                     softmax_init, softmax_result)


def _flash_kernel(lens_ref, q_ref, k_ref, v_ref, *refs, block_q, block_k, causal, sliding_window, soft_cap,
                  scale):
    # lens_ref [1, 4]: q_start, k_start, q_len, k_len; q_ref [block_q, D]; k_ref, v_ref [keys, D]
    o_ref, lse_ref = refs[-2:]
    head_dim = q_ref.shape[-1]
    q_start, k_start, q_len, k_len = lens_ref[0, 0], lens_ref[0, 1], lens_ref[0, 2], lens_ref[0, 3]
    first = pl.program_id(2) * block_q
    q = q_ref[...]
    q_idx = first + jnp.arange(block_q)
    q_pos = jnp.where(q_idx < q_len, q_start + q_idx, -(2 ** 30))[:, None]  # [block_q, 1]; padding sees nothing

    def visit(j, carry):
        k = k_ref[pl.ds(j * block_k, block_k), :]
        v = v_ref[pl.ds(j * block_k, block_k), :].astype(q.dtype)
        k_idx = j * block_k + jnp.arange(block_k)[None, :]
        k_pos = k_start + k_idx
        visible = (k_idx < k_len) & (q_pos > -(2 ** 30))
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        return softmax_block(*carry, scores(q, k, scale, soft_cap), visible, v)

    # Only the key blocks some query of this block can see.
    last_q_pos = q_start + jnp.minimum(first + block_q, q_len) - 1
    hi = pl.cdiv(jnp.minimum(k_len, last_q_pos - k_start + 1), block_k) if causal else pl.cdiv(k_len, block_k)
    lo = 0
    if sliding_window is not None:
        lo = jnp.maximum(q_start + first - sliding_window + 1 - k_start, 0) // block_k
    carry = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), visit, softmax_init(block_q, head_dim))
    out, lse = softmax_result(*carry)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "soft_cap", "block_q", "block_k",
                                             "interpret", "poison"))
def flash_attention(q, k, v, q_start, k_start, q_lens, k_lens, *, causal=True, sliding_window=None, soft_cap=None,
                    block_q=64, block_k=64, interpret=False, poison=False):
    """q [B, T, H, D]; k, v [B, L, KVH, D]; q_start, k_start, q_lens, k_lens [B] int.

    Query i of row b is at position q_start[b] + i (real if i < q_lens[b]); key j at k_start[b] + j (real if
    j < k_lens[b]). Returns (out [B, T, H, D] in q's dtype, lse [B, T, H] float32; MASKED where nothing was seen).
    """
    B, T, H, D = q.shape
    _, L, KVH, _ = k.shape
    G = H // KVH
    block_q = min(block_q, max(16, 1 << (T - 1).bit_length()))
    block_k = min(block_k, max(16, 1 << (L - 1).bit_length()))
    Tp, Lp = -(-T // block_q) * block_q, -(-L // block_k) * block_k
    q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, Lp - L), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, Lp - L), (0, 0), (0, 0)))
    lens = jnp.stack([q_start, k_start, q_lens, k_lens], axis=1).astype(jnp.int32).reshape(B, 1, 4)
    kernel = functools.partial(_flash_kernel, block_q=block_q, block_k=block_k, causal=causal,
                               sliding_window=sliding_window, soft_cap=soft_cap, scale=D ** -0.5)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
    extra, aliases = poisoned(out_shape, 4) if poison else ([], {})
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, H, Tp // block_q),
        in_specs=[
            pl.BlockSpec((None, 1, 4), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, block_q, None, D), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, Lp, None, D), lambda b, h, i: (b, 0, h // G, 0)),  # the shared KV head
            pl.BlockSpec((None, Lp, None, D), lambda b, h, i: (b, 0, h // G, 0)),
        ] + [pl.BlockSpec(memory_space=pl.ANY)] * len(extra),
        out_specs=[pl.BlockSpec((None, block_q, None, D), lambda b, h, i: (b, i, h, 0)),
                   pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton: see paged_attention.py
        interpret=interpret,
        name="flash_attention",
    )(lens, q, k, v, *extra)
    return o[:, :T], lse[:, :, :T].transpose(0, 2, 1)


def flash_attention_reference(q, k, v, q_start, k_start, q_lens, k_lens, *, causal=True, sliding_window=None,
                              soft_cap=None):
    """The same function, directly: the whole score matrix, masked, softmaxed."""
    B, T, H, D = q.shape
    _, L, KVH, _ = k.shape
    qf = q.reshape(B, T, KVH, H // KVH, D).astype(jnp.float32)
    s = jnp.einsum("bqkgd,blkd->bqkgl", qf, k.astype(jnp.float32)) * D ** -0.5
    s = s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)
    q_idx, k_idx = jnp.arange(T)[None, :, None], jnp.arange(L)[None, None, :]
    q_pos, k_pos = q_start[:, None, None] + q_idx, k_start[:, None, None] + k_idx
    visible = (q_idx < q_lens[:, None, None]) & (k_idx < k_lens[:, None, None])  # [B, T, L]
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return masked_softmax_attention(s, visible[:, :, None, None, :], v.astype(jnp.float32), (B, T, H, D), q.dtype)
