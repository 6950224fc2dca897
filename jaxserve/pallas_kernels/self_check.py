"""A start-up check of the kernels on the device at hand: compare both with their references on small random inputs
at the model's head shapes, then compile them at the largest shapes serving will use (resource limits: registers,
shared memory, VMEM, SMEM for the page table show only there). `attention_backend="auto"` uses the kernels only
if this passes (and says so in the log when it does not), so a kernel that a new backend version cannot lower
never takes the engine down with it; `"pallas"` asked for explicitly raises instead. With kv_cache_dtype="int8" the paged kernel is
checked (and compiled) reading int8 pages (`Int8Pages`), as serving will call it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_cache import Int8Pages, check_kv_cache_dtype, write_pages
from jaxserve.pallas_kernels import kernels_for
from jaxserve.pallas_kernels.flash_attention import flash_attention_reference
from jaxserve.pallas_kernels.paged_attention import paged_attention_reference


def check_kernels(backend: str, num_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype,
                  sliding_window: int | None = None, serving: dict | None = None, *,
                  kv_cache_dtype: str = "auto") -> str | None:
    """None if both kernels of `backend` compile and agree with their references; else what went wrong.

    serving: {num_pages, pages_per_seq, max_num_seqs, max_chunk}, the largest shapes to compile (not run).
    kv_cache_dtype: "auto" (pages in `dtype`) or "int8" (the paged kernel reads Int8Pages).
    """
    int8 = check_kv_cache_dtype(kv_cache_dtype) == "int8"
    paged, flash = kernels_for(backend)
    rng = np.random.default_rng(0)
    tol = 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-3
    S, Q, pages = 2, 3, 4
    try:
        k_pages = jnp.asarray(rng.standard_normal((S * pages + 1, page_size, kv_heads, head_dim)), dtype)
        v_pages = jnp.asarray(rng.standard_normal((S * pages + 1, page_size, kv_heads, head_dim)), dtype)
        if int8:
            k_pages, v_pages = quantize_pages(k_pages), quantize_pages(v_pages)
        table = jnp.asarray(1 + np.arange(S * pages).reshape(S, pages), jnp.int32)
        q = jnp.asarray(rng.standard_normal((S, Q, num_heads, head_dim)), dtype)
        kv_lens = jnp.asarray([page_size + 3, 2 * page_size], jnp.int32)
        positions = kv_lens[:, None] + jnp.arange(Q)[None, :]
        got = paged(q, k_pages, v_pages, table, kv_lens, positions, sliding_window=sliding_window)[0]
        want = paged_attention_reference(q, k_pages, v_pages, table, kv_lens, positions,
                                         sliding_window=sliding_window)[0]
        if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol):
            return "paged attention disagrees with its reference"
        k = jnp.asarray(rng.standard_normal((1, 21, kv_heads, head_dim)), dtype)
        v = jnp.asarray(rng.standard_normal((1, 21, kv_heads, head_dim)), dtype)
        q = jnp.asarray(rng.standard_normal((1, 21, num_heads, head_dim)), dtype)
        zero, n = jnp.zeros(1, jnp.int32), jnp.full((1,), 21, jnp.int32)
        got = flash(q, k, v, zero, zero, n, n, sliding_window=sliding_window)[0]
        want = flash_attention_reference(q, k, v, zero, zero, n, n, sliding_window=sliding_window)[0]
        if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol):
            return "flash attention disagrees with its reference"
        if serving is not None:
            _compile_serving_shapes(paged, flash, num_heads, kv_heads, head_dim, page_size, dtype, sliding_window,
                                    int8, **serving)
    except Exception as e:  # noqa: BLE001 - any failure to lower or run is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


def quantize_pages(pages):
    """Float pages [num_pages, page_size, kv_heads, head_dim] -> Int8Pages, quantized as the cache writes them."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    empty = Int8Pages(jnp.zeros(pages.shape, jnp.int8), jnp.zeros(pages.shape[:-1], jnp.float32))
    return write_pages(empty, pages.reshape(-1, kv_heads, head_dim), jnp.arange(num_pages * page_size))


def _compile_serving_shapes(paged, flash, num_heads, kv_heads, head_dim, page_size, dtype, sliding_window, int8, *,
                            num_pages, pages_per_seq, max_num_seqs, max_chunk):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    shape = (num_pages, page_size, kv_heads, head_dim)
    pages = (Int8Pages(sds(shape, jnp.int8), sds(shape[:-1], jnp.float32)) if int8 else sds(shape, dtype))
    for seqs, tokens in [(max_num_seqs, 1), (1, max_chunk)]:  # the largest decode and prefill steps
        jax.jit(lambda *a: paged(*a, sliding_window=sliding_window)).lower(
            sds((seqs, tokens, num_heads, head_dim), dtype), pages, pages, sds((seqs, pages_per_seq), i32),
            sds((seqs,), i32), sds((seqs, tokens), i32)).compile()
    new = sds((1, max_chunk, kv_heads, head_dim), dtype)
    jax.jit(lambda *a: flash(*a, sliding_window=sliding_window)).lower(
        sds((1, max_chunk, num_heads, head_dim), dtype), new, new, *[sds((1,), i32)] * 4).compile()
