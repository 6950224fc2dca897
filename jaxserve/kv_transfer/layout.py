"""KVPages as a flat list of arrays and a layout that rebuilds it: what both transfer paths send.

KVPages (jaxserve.cache.transfer): a sequence's pages, per layer (k, v), each [n, kv_heads, page_size, head_dim] of
the cache dtype, or `Int8Pages` (int8 values [n, kv_heads, page_size, head_dim], float32 scale [n, kv_heads,
page_size]). The layout names a layer's kind ("dense" | "int8"), never a class or a callable: what a socket sends
picks among known shapes, it does not say what to construct.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxserve.cache.kv_cache import Int8Pages
from jaxserve.kv_transfer.errors import KVTransferError

DENSE, INT8 = "dense", "int8"
# The dtypes pages may have, by name: what a header names is looked up here, never passed to np.dtype as it came
DTYPES = {name: np.dtype(t) for name, t in [("float32", np.float32), ("float16", np.float16),
                                             ("bfloat16", ml_dtypes.bfloat16), ("int8", np.int8),
                                             ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
                                             ("float8_e5m2", ml_dtypes.float8_e5m2)]}
ARRAYS_PER_LAYER = {DENSE: 2, INT8: 4}  # dense: k, v; int8: k.values, k.scale, v.values, v.scale


def flatten_pages(kv) -> tuple[list[str], list]:
    """(layer kinds, arrays in order); a KVTransferError if kv is not KVPages."""
    if not isinstance(kv, (list, tuple)):
        raise KVTransferError(f"KV pages must be a per-layer list of (k, v), got {type(kv).__name__}")
    kinds, arrays = [], []
    for i, layer in enumerate(kv):
        if not isinstance(layer, (list, tuple)) or len(layer) != 2:
            raise KVTransferError(f"layer {i} of the KV pages is not a (k, v) pair")
        k, v = layer
        if isinstance(k, Int8Pages) and isinstance(v, Int8Pages):
            kinds.append(INT8)
            arrays += [k.values, k.scale, v.values, v.scale]
        elif not isinstance(k, Int8Pages) and not isinstance(v, Int8Pages):
            kinds.append(DENSE)
            arrays += [k, v]
        else:
            raise KVTransferError(f"layer {i} of the KV pages mixes Int8Pages and plain arrays")
    check_shapes(kinds, [(tuple(a.shape), str(a.dtype)) for a in arrays])
    return kinds, arrays


def unflatten_pages(kinds: list[str], arrays: list) -> list:
    """The inverse of flatten_pages (shapes checked by the caller with check_shapes)."""
    out, it = [], iter(arrays)
    for kind in kinds:
        if kind == INT8:
            out.append((Int8Pages(next(it), next(it)), Int8Pages(next(it), next(it))))
        else:
            out.append((next(it), next(it)))
    return out


def check_shapes(kinds, specs: list[tuple[tuple[int, ...], str]]) -> None:
    """KVTransferError unless specs [(shape, dtype name)] are KVPages of these layer kinds: dtypes of DTYPES, every
    layer's k and v alike, rank 4, int8 values with a float32 scale of their shape less head_dim."""
    if not isinstance(kinds, list) or any(not isinstance(kind, str) or kind not in ARRAYS_PER_LAYER for kind in kinds):
        raise KVTransferError(f"unknown layer kinds in {kinds!r}: each must be one of {sorted(ARRAYS_PER_LAYER)}")
    if len(specs) != sum(ARRAYS_PER_LAYER[kind] for kind in kinds):
        raise KVTransferError(f"{len(specs)} arrays for layer kinds {kinds}")
    unknown = {dtype for _, dtype in specs} - set(DTYPES)
    if unknown:
        raise KVTransferError(f"KV pages of dtype {', '.join(sorted(unknown))}: not one of {', '.join(DTYPES)}")
    if any(d < 0 for shape, _ in specs for d in shape):
        raise KVTransferError("KV pages with a negative dimension")
    i = 0
    for layer, kind in enumerate(kinds):
        n = ARRAYS_PER_LAYER[kind]
        group = specs[i:i + n]
        i += n
        k, v = (group[0], group[1]) if kind == DENSE else (group[0], group[2])
        if k != v or len(k[0]) != 4:
            raise KVTransferError(f"layer {layer}: k {k} and v {v} must be alike, [n, kv_heads, page_size, head_dim]")
        if kind == INT8:
            if k[1] != "int8" or group[1] != group[3] or group[1] != (k[0][:3], "float32"):
                raise KVTransferError(f"layer {layer}: Int8Pages must be int8 values {k} with float32 scales of "
                                      f"shape [n, kv_heads, page_size], got {group[1]} and {group[3]}")
