"""A sequence's KV pages out of one paged cache and into another: what moves a prefilled request to a decode engine.

`KVPages` is the cache pytree cut to some pages: per layer (k, v), each [n, kv_heads, page_size, head_dim'] (or
`Int8Pages`, values and scales together), as jax arrays (still on the exporting mesh, split over KV heads as its
cache is) or numpy arrays (after a trip through host memory or a socket). The runner jits both directions over a
few page-count buckets (`ModelRunner.export_pages` / `import_pages`), so an exported KVPages may hold more pages
than the sequence has: the extra ones are copies of the scratch page, and an import drops them.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxserve.cache.kv_cache import SCRATCH_PAGE, as_stored, as_values, take_pages

KVPages = list  # per layer (k, v): each [n, kv_heads, page_size, head_dim'] (or Int8Pages), jax or numpy arrays


def gather_pages(kv_cache, page_ids) -> KVPages:
    """The pages page_ids [n] of every layer: [n, kv_heads, page_size, head_dim'] each (an int8 cache's scales
    [n, kv_heads, page_size] with its values). A cache stored as bf16 bits (CPU) exports bf16: what any bf16 cache
    imports."""
    return jax.tree.map(lambda pages: as_values(take_pages(pages, page_ids)), kv_cache)


def scatter_pages(kv_cache, page_ids, kv: KVPages):
    """kv_cache with kv's pages written at page_ids [n] (kv holds n pages); a page id given twice (the scratch
    page, padding) is written by one of them."""
    return jax.tree.map(lambda pages, x: pages.at[page_ids].set(as_stored(x, pages)), kv_cache, kv)


def is_ready(kv: KVPages) -> bool:
    """Every array of kv has landed (numpy ones always have)."""
    return all(getattr(x, "is_ready", lambda: True)() for x in jax.tree.leaves(kv))


def num_pages(kv: KVPages) -> int:
    """Pages kv holds (padding included)."""
    return jax.tree.leaves(kv)[0].shape[0]


def kv_bytes(kv: KVPages) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(kv))


def trimmed(kv: KVPages, n: int) -> KVPages:
    """kv's first n pages on the host (numpy): what to send when an export's padding need not travel. A copy, not
    a view: a view would keep the whole padded export alive for as long as the pages wait to be fetched."""
    return jax.tree.map(lambda x: np.array(np.asarray(x)[:n]), kv)


def padded_ids(page_ids, size: int) -> np.ndarray:
    """page_ids [n] as int32 [size], padded with the scratch page."""
    ids = np.full(size, SCRATCH_PAGE, np.int32)
    ids[:len(page_ids)] = page_ids
    return ids
