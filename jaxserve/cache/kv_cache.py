"""The paged KV cache: per layer a K and a V page array, a plain pytree donated through every step."""
from __future__ import annotations

import jax.numpy as jnp

from jaxserve.config import ModelConfig

# Page 0 is never handed to a sequence: padding tokens write their K/V there, so a padded step needs no masking
# of writes and no real page is ever touched by padding.
SCRATCH_PAGE = 0


def bytes_per_page(config: ModelConfig, page_size: int, dtype) -> int:
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def num_pages_for_budget(config: ModelConfig, page_size: int, dtype, memory_bytes: int) -> int:
    n = memory_bytes // bytes_per_page(config, page_size, dtype)
    if n < 2:
        raise ValueError(f"a KV-cache budget of {memory_bytes} bytes holds fewer than 2 pages of {page_size} tokens")
    return int(n)


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype) -> list[tuple]:
    """Returns per layer (k_pages, v_pages), each [num_pages, page_size, kv_heads, head_dim], zeroed."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]
