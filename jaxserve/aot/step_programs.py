"""A step program's abstract inputs and its compile (with its cache write where that is a program of its own), shared
by the target's steps (`jaxserve.aot.deviceless`) and a speculative head's (`jaxserve.aot.head_programs`)."""
from __future__ import annotations

import jax
import numpy as np

from jaxserve.runner.batch_builder import build_batch


def abstract_batch(page_size: int, vocab_size: int, tokens: int, rows: int, pages_per_row: int, num_scored: int = 1):
    """An empty step batch of that shape, as ShapeDtypeStructs."""
    batch = build_batch([], page_size, vocab_size, tokens, rows, pages_per_row, num_scored)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)


def step_and_write(compile_, prefix: str, shape: str, steps, forward, args, shardings, write_shardings) -> list:
    """A step program over args (the cache second, the batch among them) and, where it does not write the cache
    itself (`steps.writes_in_forward`: one CPU device), its cache write: "step" and "cache write" after prefix."""
    results = [compile_(f"{prefix}step", shape, forward, args, shardings, ("weights", "cache"))]
    if not steps.writes_in_forward:  # the cache write is a program of its own (jaxserve.runner.steps)
        new_kv = jax.eval_shape(forward, *args)[1]
        slots = next(a.slot_mapping for a in args if hasattr(a, "slot_mapping"))
        results.append(compile_(f"{prefix}cache write", shape, steps._write, (args[1], new_kv, slots),
                                write_shardings, ("cache",)))
    return results
