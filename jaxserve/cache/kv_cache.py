"""The paged KV cache: per layer a K and a V page array, a plain pytree donated through every step.

Pages are head-major, [num_pages, kv_heads, page_size, head_dim]: one KV head of one page is a contiguous
[page_size, head_dim] tile, so a kernel fetches (DMA, TPU) or loads (GPU) a head's keys of a page as one block,
and TPU's (8, 128)-tiled layout of the two minor dimensions holds them without padding when head_dim is a multiple
of 128. Where the attention kernel needs that (TPU), the stored head_dim is padded up to `head_dim_multiple`
with zeros (written as zeros: a query padded alike scores the same); everything that reads pages slices it back.

Pages hold the model's dtype, or int8 with a float32 scale per token and KV head beside them (`Int8Pages`): about
half of bfloat16's bytes (a quarter of float32's), so a memory budget holds about twice the sequences.

bfloat16 pages on XLA:CPU are stored as their bits, uint16 (`bf16_pages_as_bits`): XLA:CPU has no bf16 scatter or
in-place update (it converts the whole page array to float32 and back around one, every layer and step) and gathers
bf16 rows element by element, while a uint16 array is written in place and gathered as fast as float32; the bits
become bf16 again only in the gathered block (`read_blocks`). Engine steps with the default model's cache as
LLM sizes it for 16 sequences (1025 pages; interleaved, 2026-12-02, loaded 2 vCPU), ms per step, bf16 pages / bits /
float32 pages: batch 1 247 / 35 / 38, batch 16 279 / 89 / 107, batch 64 516 / 283 / 330, a 512-token prompt
935 / 524 / 536 (a float32 model's: 33, 136, 372, 979).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

# Page 0 is never handed to a sequence: padding tokens write their K/V there, so a padded step needs no masking
# of writes and no real page is ever touched by padding.
SCRATCH_PAGE = 0
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
BF16_BITS = jnp.dtype(jnp.uint16)  # how a bfloat16 cache is stored on CPU (`bf16_pages_as_bits`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Pages:
    values: jax.Array  # int8 [num_pages, kv_heads, page_size, head_dim]
    scale: jax.Array  # float32 [num_pages, kv_heads, page_size]: a token's head ~= values * scale

    @property
    def shape(self):
        return self.values.shape


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def stored_head_dim(head_dim: int, head_dim_multiple: int = 1) -> int:
    """head_dim as the pages store it: rounded up to a multiple (TPU: 128 lanes)."""
    return -(-head_dim // head_dim_multiple) * head_dim_multiple


def bytes_per_page(config: ModelConfig, page_size: int, dtype, kv_cache_dtype: str = "auto",
                   head_dim_multiple: int = 1) -> int:
    head_dim = stored_head_dim(config.head_dim, head_dim_multiple)
    per_head = (head_dim + 4 if kv_cache_dtype == "int8"
                else head_dim * jnp.dtype(dtype).itemsize)  # int8: a byte per value and a float32 scale
    return 2 * config.num_layers * page_size * config.num_kv_heads * per_head


def num_pages_for_budget(config: ModelConfig, page_size: int, dtype, memory_bytes: int,
                         kv_cache_dtype: str = "auto", extra_bytes_per_page: int = 0,
                         head_dim_multiple: int = 1) -> int:
    """Pages the budget holds; extra_bytes_per_page: what else a page id costs (a draft model's page in its own
    cache, a speculative head's: `jaxserve.engine.speculation`)."""
    per_page = bytes_per_page(config, page_size, dtype, kv_cache_dtype, head_dim_multiple) + extra_bytes_per_page
    n = memory_bytes // per_page
    if n < 2:
        raise ValueError(f"a KV-cache budget of {memory_bytes} bytes holds fewer than 2 pages of {page_size} tokens")
    return int(n)


def bf16_pages_as_bits(platform: str, attention_backend: str) -> bool:
    """Whether a bfloat16 cache is stored as its bits (uint16, see the module's docstring): on CPU, where the jnp
    attention (resolved backend "reference" or "dense") reads it; Pallas kernels read bf16 pages as they are."""
    return platform == "cpu" and attention_backend in ("reference", "dense")


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype, kv_cache_dtype: str = "auto",
                  head_dim_multiple: int = 1, bf16_as_bits: bool = False):
    """Returns per layer (k_pages, v_pages), each [num_pages, kv_heads, page_size, head_dim'] (or Int8Pages), zeroed;
    head_dim' is head_dim rounded up to head_dim_multiple. bf16_as_bits: a bfloat16 cache is stored as uint16 bits
    (`bf16_pages_as_bits`); pages are read and written alike either way (`read_head_major`, `write_pages`)."""
    shape = (num_pages, config.num_kv_heads, page_size, stored_head_dim(config.head_dim, head_dim_multiple))
    if check_kv_cache_dtype(kv_cache_dtype) == "int8":
        def pages():
            return Int8Pages(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32))
    else:
        stored = BF16_BITS if bf16_as_bits and jnp.dtype(dtype) == jnp.bfloat16 else dtype

        def pages():
            return jnp.zeros(shape, stored)
    return [(pages(), pages()) for _ in range(config.num_layers)]


def values_dtype(pages):
    """The dtype of the values a page array holds: bfloat16 for one stored as bits."""
    return jnp.dtype(jnp.bfloat16) if pages.dtype == BF16_BITS else pages.dtype


def as_values(x):
    """Pages as stored -> their values: bits viewed as bfloat16 (no conversion), anything else as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def as_stored(x, pages):
    """Values x in the form pages store them: cast to their values' dtype, as bits if they hold bits."""
    x = x.astype(values_dtype(pages))
    return jax.lax.bitcast_convert_type(x, BF16_BITS) if pages.dtype == BF16_BITS else x


def read_pages(pages, page_ids, dtype, head_dim: int | None = None) -> jax.Array:
    """pages[page_ids] in dtype, token-major: [*page_ids.shape, page_size, kv_heads, head_dim] (the stored head_dim
    cut to head_dim, if given). For oracles and tests; the attention paths read blocks head by head
    (`read_blocks`)."""
    return jnp.swapaxes(read_head_major(pages, page_ids, dtype, head_dim), -3, -2)


def read_head_major(pages, page_ids, dtype, head_dim: int | None = None) -> jax.Array:
    """pages[page_ids] in dtype as stored: [*page_ids.shape, kv_heads, page_size, head_dim] (cut to head_dim)."""
    return _read(take_pages, pages, page_ids, dtype, head_dim)


def read_blocks(pages, page_ids, dtype, head_dim: int | None = None) -> jax.Array:
    """The keys (or values) of pages[page_ids] head by head, in dtype: page_ids [..., n] -> [..., kv_heads,
    n * page_size, head_dim] (cut to head_dim), the layout that a dot batched over KV heads reads as it is. Gathered
    as one [page_size, head_dim] tile per (page, head): read as stored (`read_head_major`), every block was
    transposed into this layout after its gather, ~20% of a decode step's attention on XLA:CPU (the default model's
    layer after 512 tokens, one row 0.126 -> 0.105 ms, 16 rows 1.29 -> 1.12, interleaved, 2026-12-05)."""
    return _read(_take_tiles, pages, page_ids, dtype, head_dim)


def _read(take, pages, page_ids, dtype, head_dim):
    if isinstance(pages, Int8Pages):
        x = take(pages.values, page_ids).astype(dtype) * take(pages.scale, page_ids)[..., None].astype(dtype)
    elif pages.dtype == BF16_BITS:
        # The bits as bf16 only once gathered, kept apart from the conversion: fused with it, XLA:CPU gathers element
        # by element (32 pages of 1025 for 64 rows, converted to float32: 2.0 ms apart, 3.5 fused; float32's 2.9).
        x = as_values(jax.lax.optimization_barrier(take(pages, page_ids))).astype(dtype)
    else:
        x = take(pages, page_ids).astype(dtype)
    return x if head_dim is None else x[..., :head_dim]


def _take_tiles(pages, page_ids) -> jax.Array:
    """pages [num_pages, kv_heads, page_size, ...] at page_ids [..., n] -> [..., kv_heads, n * page_size, ...]: on
    CPU, rows (page, head) of the flat [num_pages * kv_heads, tile] view, each copied as one block (`take_pages`);
    elsewhere whole pages, then the gathered block transposed: on TPU the flat view is no view but a copy of the
    whole page array, its (8, 128) tiles laid over [page_size, head_dim] (268 MB a step for SmolLM2's two layers
    at 128K, found by the HBM audit of a decode-context-parallel step)."""
    return jax.lax.platform_dependent(pages, page_ids, cpu=_take_flat_tiles, default=take_tiles_by_page)


def take_tiles_by_page(pages, page_ids) -> jax.Array:
    """`read_blocks`' gather off CPU: whole pages [..., n, kv_heads, page_size, ...], then heads first."""
    x = pages[page_ids]  # [..., n, kv_heads, page_size, ...]
    x = jnp.moveaxis(x, page_ids.ndim, page_ids.ndim - 1)  # [..., kv_heads, n, page_size, ...]
    return x.reshape(*x.shape[:page_ids.ndim], -1, *pages.shape[3:])


def _take_flat_tiles(pages, page_ids) -> jax.Array:
    num_pages, kv_heads, page_size = pages.shape[:3]
    flat = pages.reshape(num_pages * kv_heads, -1)  # [num_pages * kv_heads, page_size * ...]
    rows = page_ids[..., None, :] * kv_heads + jnp.arange(kv_heads, dtype=page_ids.dtype)[:, None]  # [..., KVH, n]
    return flat[rows].reshape(*rows.shape[:-1], rows.shape[-1] * page_size, *pages.shape[3:])


def take_pages(pages, page_ids) -> jax.Array:
    """pages[page_ids], gathered as whole flat pages: XLA:CPU copies a row of a 2-D array as one block, but gathers
    from the 4-D array element by element (measured 5x slower: 2.8 ms against 13.4 ms for 2112 pages)."""
    flat = pages.reshape(pages.shape[0], -1)[page_ids]  # [*page_ids.shape, page elements]
    return flat.reshape(*page_ids.shape, *pages.shape[1:])


def write_pages(pages, x, slots):
    """Scatters x [tokens, kv_heads, head_dim] into flat slots [tokens] (page * page_size + offset), zero-padded to
    the stored head_dim."""
    # Indexed by (page, offset), not through a reshape to flat slots: with a single KV head (Gemma 3) the reshaped
    # scatter made XLA:CPU copy every layer's whole page array instead of writing in place (85 ms a step, measured).
    page_size, stored = pages.shape[2], pages.shape[3]
    page, offset = slots // page_size, slots % page_size
    x = jnp.pad(x, ((0, 0), (0, 0), (0, stored - x.shape[-1])))
    if isinstance(pages, Int8Pages):
        x32 = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0  # [tokens, kv_heads]: per token and head
        scale = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(x32 / scale[..., None]), -127, 127).astype(jnp.int8)
        return Int8Pages(pages.values.at[page, :, offset].set(q), pages.scale.at[page, :, offset].set(scale))
    return pages.at[page, :, offset].set(as_stored(x, pages))
