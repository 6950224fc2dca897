"""The pieces the Pallas attention kernels share: float32-accumulating dots, an online softmax over blocks of keys,
and int8 pages (`Int8Pages`) split into values and scales and dequantized as they are loaded."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache.kv_cache import Int8Pages

MASKED = -1e30  # finite: a row that sees nothing stays NaN-free


def dot_t(a, b):
    """a @ b.T accumulated in float32: [m, d] x [n, d] -> [m, n]. Operands stay in their dtype (bf16 on tensor
    cores / the MXU; a float32 dot would run multi-pass or without tensor cores)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
    """a @ b accumulated in float32, operands in b's dtype."""
    return jax.lax.dot_general(a.astype(b.dtype), b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def scores(q, k, scale):
    """Scaled q @ k.T in float32: [rows, D] x [keys, D] -> [rows, keys]."""
    return dot_t(q, k.astype(q.dtype)) * scale


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


def pad_head_dim(head_dim: int, *xs):
    """Arrays [..., D] zero-padded to head_dim (the pages' stored width, `jaxserve.cache.kv_cache`): a padded query
    scores padded keys exactly as the unpadded ones, and a padded value's extra lanes are cut from the output."""
    return [x if x.shape[-1] == head_dim else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])
            for x in xs]


def pow2(n: int, lo: int = 1) -> int:
    """The least power of two >= n and >= lo (Triton's blocks are powers of two)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The greatest power of two <= n (1 for n < 1)."""
    return 1 << (max(n, 1).bit_length() - 1)
