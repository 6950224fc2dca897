"""How a step's inputs reach its programs: numpy or device arrays, one device copy of each constant.

Each step kind (`jaxserve.runner.steps`, `jaxserve.runner.head_steps`) holds one BatchPlacer for its mesh.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxserve.batch import StepInput, is_constant
from jaxserve.parallel.mesh import replicated

# The fields of a StepInput that a batch holds as a `jaxserve.batch.constant` when no row uses them (batch_builder).
MAYBE_CONSTANT = frozenset({"token_mask", "bad_word_bans", "logit_bias_ids", "logit_bias", "past_tokens",
                            "prompt_targets", "prompt_top", "lora_slot", "sample_rows"})


class BatchPlacer:
    def __init__(self, mesh=None):
        """mesh: the device group the programs run on (None: the default device)."""
        self.mesh = mesh
        self._replicated = None if mesh is None else replicated(mesh)
        self._constants: dict[tuple, jax.Array] = {}  # (shape, dtype, value) -> its device copy

    def put(self, batch: StepInput) -> StepInput:
        """A step's inputs as its programs take them (an array no row uses, a `jaxserve.batch.constant`, is copied
        once and kept). On one device the per-step arrays stay numpy: a jitted call copies its numpy arguments in
        its C++ dispatch, which costs less than device_put's Python path per array (batch 1: the forward's call
        with them 1.0 ms against 2.2 ms for device_put and the call). A field that may hold a constant is always a
        device array, so that each argument of a program is always of one kind: a numpy argument where a device
        array was is a new entry of jit's dispatch cache. Over a mesh: replicated, from each process's own copy of
        the same values, with no cross-process check (device_put's is a collective)."""
        if self.mesh is None:
            return jax.tree_util.tree_map_with_path(self._put_leaf, batch)
        return jax.tree.map(lambda x: self._constant(x) if is_constant(x) else
                            jax.make_array_from_process_local_data(self._replicated, np.asarray(x)), batch)

    def _put_leaf(self, path, x):
        if path[-1].name not in MAYBE_CONSTANT:
            return x
        return self._constant(x) if is_constant(x) else jax.device_put(x)

    def _constant(self, x):
        if not is_constant(x):
            return x
        key = (x.shape, x.dtype.str, x.flat[0].item())
        if key not in self._constants:
            self._constants[key] = (jax.device_put(x) if self.mesh is None else
                                    jax.make_array_from_process_local_data(self._replicated, np.asarray(x)))
        return self._constants[key]
