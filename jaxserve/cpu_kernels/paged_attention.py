"""The attention of a few-token step on CPU by the kernel in paged_attention.cc: cached keys read from the pages in
place, then the step's own keys (jaxserve.model.attention.ragged_attention takes it for steps of at most `small_step`
tokens)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.cpu_kernels import build

TARGET = "jaxserve_paged_attention"


def _registered() -> None:
    if not available():
        raise RuntimeError("the CPU kernels are switched off or could not be built (see the jaxserve log)")


def available() -> bool:
    """The kernel is built and registered with XLA:CPU (False where it cannot be built, or is switched off)."""
    return build.register("paged_attention.cc", ((TARGET, "JaxservePagedAttention"),))


def paged_attention(q, k, v, token_row, positions, cached_lens, page_ids, k_pages, v_pages, k_scale=None,
                    v_scale=None, sliding_window=None):
    """Each token's attention to its row's cached keys 0 .. cached_lens[t] - 1 and to the step's own keys of its
    row up to its position (and after position - sliding_window, if given), in float32.

    q:           [T, kv_heads, G, head_dim], already scaled by head_dim ** -0.5
    k, v:        [T, kv_heads, head_dim]   the step's own keys and values
    token_row, positions, cached_lens: int32 [T]   (position < 0: padding, attends to nothing, gets zeros)
    page_ids:    int32 [T, P]   each token's row's pages, in order
    k_pages, v_pages: [num_pages, kv_heads, page_size, head_dim'] float32, bf16 bits (uint16) or int8 with
                 k_scale, v_scale float32 [num_pages, kv_heads, page_size]
    Returns float32 [T, kv_heads, G, head_dim].
    """
    _registered()
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    none = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(f32(q), f32(k), f32(v), i32(token_row), i32(positions), i32(cached_lens), i32(page_ids), k_pages,
                v_pages, none if k_scale is None else k_scale, none if v_scale is None else v_scale,
                sliding_window=sliding_window or 0)
