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
                    v_scale=None, sliding_window=None, bf16_dots=False):
    """Each token's attention to its row's cached keys 0 .. cached_lens[t] - 1 and to the step's own keys of its
    row up to its position (and after position - sliding_window, if given), in float32.

    q:           [T, kv_heads, G, head_dim], already scaled by head_dim ** -0.5
    k, v:        [T, kv_heads, head_dim]   the step's own keys and values
    token_row, positions, cached_lens: int32 [T]   (position < 0: padding, attends to nothing, gets zeros)
    page_ids:    int32 [T, P]   each token's row's pages, in order
    k_pages, v_pages: [num_pages, kv_heads, page_size, head_dim'] float32, bf16 bits (uint16) or int8 with
                 k_scale, v_scale float32 [num_pages, kv_heads, page_size]
    bf16_dots:   bf16 pages' products may round q and the softmax weights to bf16 (two exact products a lane
                 summed in float32, where the CPU has AVX-512-BF16 and head_dim is 64, 128 or 256: bf16_dots.h);
                 for a model that computes in bf16, whose q is bf16 already. Elsewhere the products are float32.
    Returns float32 [T, kv_heads, G, head_dim].
    """
    _registered()
    check_operands(q, k, v, token_row, positions, cached_lens, page_ids, k_pages, v_pages, k_scale, v_scale)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    none = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(f32(q), f32(k), f32(v), i32(token_row), i32(positions), i32(cached_lens), i32(page_ids), k_pages,
                v_pages, none if k_scale is None else k_scale, none if v_scale is None else v_scale,
                sliding_window=sliding_window or 0, bf16_dots=bool(bf16_dots))


PAGE_DTYPES = ("float32", "bfloat16", "uint16", "int8")  # uint16: bf16 pages stored as their bits


def check_operands(q, k, v, token_row, positions, cached_lens, page_ids, k_pages, v_pages, k_scale=None,
                   v_scale=None) -> None:
    """ValueError naming the first operand whose shape or dtype does not go with q's and the pages' (the kernel
    checks them too, but XLA reports its refusal without the operand's name, and at run time rather than at trace
    time)."""
    def need(ok: bool, operand: str, want: str, got) -> None:
        if not ok:
            raise ValueError(f"paged attention: {operand} must be {want}, got {getattr(got, 'shape', got)}"
                             f"{'' if not hasattr(got, 'dtype') else ' ' + str(got.dtype)}")

    need(len(q.shape) == 4 and 1 <= q.shape[2] <= 64, "q", "[T, kv_heads, G (1 to 64), head_dim]", q)
    T, H, _, D = q.shape
    for name, a in (("k", k), ("v", v)):
        need(tuple(a.shape) == (T, H, D), name, f"[T, kv_heads, head_dim] = {[T, H, D]}", a)
    for name, a in (("token_row", token_row), ("positions", positions), ("cached_lens", cached_lens)):
        need(tuple(a.shape) == (T,) and jnp.issubdtype(a.dtype, jnp.integer), name, f"integer [T] = [{T}]", a)
    need(len(page_ids.shape) == 2 and page_ids.shape[0] == T and jnp.issubdtype(page_ids.dtype, jnp.integer),
         "page_ids", f"integer [T = {T}, pages]", page_ids)
    need(len(k_pages.shape) == 4 and k_pages.shape[1] == H and k_pages.shape[2] >= 1 and k_pages.shape[3] >= D
         and jnp.dtype(k_pages.dtype).name in PAGE_DTYPES, "k_pages",
         f"{'/'.join(PAGE_DTYPES)} [num_pages, kv_heads = {H}, page_size >= 1, >= head_dim = {D}]", k_pages)
    need(v_pages.shape == k_pages.shape and v_pages.dtype == k_pages.dtype, "v_pages",
         f"k_pages' shape and dtype, {k_pages.shape} {k_pages.dtype}", v_pages)
    scales = tuple(k_pages.shape[:3]) if k_pages.dtype == jnp.int8 else None
    for name, a in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None:
            need(a is None, name, "None for float pages", a)
        else:
            need(a is not None and tuple(a.shape) == scales and a.dtype == jnp.float32, name,
                 f"float32 {list(scales)} (a scale per page, head and slot of int8 pages)", a)
