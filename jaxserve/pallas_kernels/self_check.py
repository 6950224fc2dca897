"""A start-up check of the ragged attention kernel on the device at hand: compare it with the oracle
(`ragged_attention_reference`) on a small random ragged batch at the model's head shapes, then compile it at the
largest step serving will run (resource limits: registers, shared memory, VMEM, SMEM show only there).
`attention_backend="auto"` uses the kernel only if this passes (and says so in the log when it does not), so a
kernel that a new backend version cannot lower never takes the engine down with it; `"pallas"` asked for
explicitly raises instead. With kv_cache_dtype="int8" the kernel is checked (and compiled) reading int8 pages
(`Int8Pages`), as serving will call it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages, check_kv_cache_dtype, stored_head_dim, write_pages
from jaxserve.pallas_kernels import page_head_dim_multiple, ragged_kernel_for
from jaxserve.pallas_kernels.reference import ragged_attention_reference


def check_kernels(backend: str, num_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype,
                  sliding_window: int | None = None, serving: dict | None = None, *,
                  kv_cache_dtype: str = "auto") -> str | None:
    """None if the ragged kernel of `backend` compiles and agrees with the oracle (or `backend` has no kernel:
    "reference" and "dense" are plain jnp); else what went wrong.

    serving: {num_pages, pages_per_seq, max_num_seqs, max_tokens}, the largest step to compile (not run).
    kv_cache_dtype: "auto" (pages in `dtype`) or "int8" (the kernel reads Int8Pages).
    """
    int8 = check_kv_cache_dtype(kv_cache_dtype) == "int8"
    if not backend.startswith("pallas-"):
        return None
    tol = 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-3
    try:
        kernel = ragged_kernel_for(backend)
        lanes = page_head_dim_multiple(backend)  # the pages as the backend stores them
        args = small_ragged_batch(np.random.default_rng(0), num_heads, kv_heads, head_dim, page_size, dtype, int8,
                                  lanes)
        got = kernel(*args, sliding_window=sliding_window)
        want = ragged_attention_reference(*args, sliding_window=sliding_window)
        if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol):
            return "ragged attention disagrees with the reference"
        if serving is not None:
            _compile_serving_shape(kernel, num_heads, kv_heads, head_dim, page_size, dtype, sliding_window, int8,
                                   lanes, **serving)
    except Exception as e:  # noqa: BLE001 - any failure to lower or run is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


def small_ragged_batch(rng, num_heads, kv_heads, head_dim, page_size, dtype, int8=False, head_dim_multiple=1):
    """(q, k, v, k_pages, v_pages, rows): a decode row, a prompt chunk after a cached prefix, a fresh prompt, then
    padding tokens and a padding row; every row crosses a page. Pages stored head_dim_multiple-padded, with random
    values in the padding too (a kernel must never read them into a result)."""
    cached, new = [page_size + 3, 2 * page_size, 0], [1, 5, page_size + 2]
    S, P = len(cached) + 1, 4
    T = sum(new) + 3
    num_pages = S * P + 1
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    stored = stored_head_dim(head_dim, head_dim_multiple)
    k_pages, v_pages = normal(num_pages, kv_heads, page_size, stored), normal(num_pages, kv_heads, page_size, stored)
    if int8:
        k_pages, v_pages = quantize_pages(k_pages), quantize_pages(v_pages)
    q, k, v = normal(T, num_heads, head_dim), normal(T, kv_heads, head_dim), normal(T, kv_heads, head_dim)
    starts = np.cumsum([0] + new)
    positions, token_row = np.full(T, -1), np.zeros(T, int)
    for r, (c, n) in enumerate(zip(cached, new)):
        positions[starts[r]:starts[r + 1]], token_row[starts[r]:starts[r + 1]] = c + np.arange(n), r
    query_start = np.append(starts, starts[-1])  # the padding row has no tokens
    table = 1 + rng.permutation(S * P).reshape(S, P)
    rows = RaggedRows(*(jnp.asarray(x, jnp.int32) for x in (positions, token_row, query_start, cached + [0], table)))
    return q, k, v, k_pages, v_pages, rows


def quantize_pages(pages):
    """Float pages [num_pages, kv_heads, page_size, head_dim] -> Int8Pages, quantized as the cache writes them."""
    num_pages, kv_heads, page_size, head_dim = pages.shape
    empty = Int8Pages(jnp.zeros(pages.shape, jnp.int8), jnp.zeros(pages.shape[:-1], jnp.float32))
    tokens = jnp.swapaxes(pages, 1, 2).reshape(-1, kv_heads, head_dim)  # [num_pages * page_size, kv_heads, D]
    return write_pages(empty, tokens, jnp.arange(num_pages * page_size))


def serving_shapes(num_heads, kv_heads, head_dim, page_size, dtype, int8, head_dim_multiple=1, *, num_pages,
                   pages_per_seq, max_num_seqs, max_tokens):
    """The kernel's arguments, as shapes, at the largest step: max_tokens tokens in min(max_tokens, max_num_seqs)
    rows (as `jaxserve.buckets` pads them)."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    T, S = max_tokens, min(max_tokens, max_num_seqs)
    shape = (num_pages, kv_heads, page_size, stored_head_dim(head_dim, head_dim_multiple))
    pages = Int8Pages(sds(shape, jnp.int8), sds(shape[:-1], jnp.float32)) if int8 else sds(shape, dtype)
    rows = RaggedRows(sds((T,), i32), sds((T,), i32), sds((S + 1,), i32), sds((S,), i32), sds((S, pages_per_seq), i32))
    new = sds((T, kv_heads, head_dim), dtype)
    return sds((T, num_heads, head_dim), dtype), new, new, pages, pages, rows


def _compile_serving_shape(kernel, num_heads, kv_heads, head_dim, page_size, dtype, sliding_window, int8, lanes,
                           **serving):
    args = serving_shapes(num_heads, kv_heads, head_dim, page_size, dtype, int8, lanes, **serving)
    jax.jit(lambda *a: kernel(*a, sliding_window=sliding_window)).lower(*args).compile()
