"""The embedding table read in place on TPU: placed row-major, and not moved into VMEM whole.

A lookup reads one row of the table per token. Two things XLA:TPU does made it read the whole table every
multi-token step instead (found by `jaxserve.aot.hbm_audit` in the deviceless compile, `jaxserve.aot.deviceless`):
- It lays a 2-D array out column-major ({0,1}) when that pads less on its (8, 128) tiles: SmolLM2's [49152, 576]
  table (the vocabulary a multiple of 128 lanes, 576 = 4.5 x 128 not) arrives so, and the gather relays the whole
  table out first (56.6 MB). Placed row-major, the table is read in place; the price is its hidden size padded to
  whole 128-lane tiles in HBM (576 -> 640: 6.3 MB for SmolLM2). A jitted program takes a committed argument's
  layout as it finds it, so placing the table so (`param_formats`, `with_row_major_tables`) is all it takes, for
  every program that reads it. Other backends' default is row-major already (nothing changes there), and so is
  TPU's for a table whose hidden size is a multiple of 128 (Llama's, Gemma's).
- Its cross-program prefetch copies one parameter that fits in VMEM into it whole before the program runs (and
  again at its end, for the next run); a parameter only gathers read qualifies (XLA's memory-space assignment
  takes it for a weight; a dynamic-slice's operand does not), so the row-major table (63 MB) was then read whole
  into VMEM instead. `lookup_compiler_options` turns it off for the programs that look rows up: a dot's weight
  moved to VMEM first is read once either way.
"""
from __future__ import annotations

import jax
from jax.experimental.layout import Format, Layout

ROW_TABLES = ("embed_tokens",)  # params looked up by row: the table, or an int8 table's values (jaxserve.model.quant)
ROW_MAJOR = Layout(major_to_minor=(0, 1))
TPU = "tpu"


def _wants_row_major(path, leaf, sharding) -> bool:
    """leaf (at path in params) is an embedding table placed (sharding) on TPU."""
    return (getattr(leaf, "ndim", 0) == 2 and any(getattr(k, "key", None) in ROW_TABLES for k in path)
            and next(iter(sharding.device_set)).platform == TPU)


def param_formats(params, shardings):
    """shardings (one per leaf of params: where each lives) with each embedding table's on TPU replaced by a
    `Format` of the row-major layout and that sharding: what to place the params on (`jaxserve.parallel.mesh.place`)
    or compile for (`ShapeDtypeStruct(sharding=...)`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf, s: Format(ROW_MAJOR, s) if _wants_row_major(path, leaf, s) else s, params, shardings)


def with_row_major_tables(params):
    """params on one device (as the loaders leave them), each embedding table on TPU moved to the row-major layout
    where it is not in it (one copy, at load)."""
    def put(path, x):
        if (not isinstance(x, jax.Array) or not _wants_row_major(path, x, x.sharding) or x.format.layout is None
                or x.format.layout.major_to_minor == ROW_MAJOR.major_to_minor):
            return x
        return jax.device_put(x, Format(ROW_MAJOR, x.sharding))
    return jax.tree_util.tree_map_with_path(put, params)


def lookup_compiler_options(platform: str) -> dict | None:
    """The compiler options of a program that looks rows of the table up, compiled for platform: on TPU no
    cross-program prefetch. None elsewhere (each compiler knows only its own options)."""
    return {"xla_msa_max_cross_program_prefetches": 0} if platform == TPU else None
