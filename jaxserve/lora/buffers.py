"""The device side of multi-LoRA: `max_loras` adapter slots as fixed-shape stacks, read by the model's linear layers.

Per layer and target, a [N, in, R] and b [N, R, out] (N = max_loras, R = max_lora_rank; an adapter of rank r fills
the first r of R, the rest stays zero, as does a target it leaves out), in the model's dtype, the "lora" collection
beside the model's "params". Each splits over a tensor-parallel mesh as its base kernel does: a column-parallel
layer's (q/k/v, gate, up) b by its outputs, a row-parallel layer's (o, down) a by its inputs, so each device
computes its own part of the term as it does of the layer (`jaxserve.parallel.mesh.RULES`).
"""
from __future__ import annotations

import functools
import threading
import weakref

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.lora.adapter import TARGETS, LoRAAdapter
from jaxserve.model.decoder import declared_params, repeat_heads


@functools.cache
def _kernels(config: ModelConfig) -> dict:
    """{"layers_i": {target: (shape [in, out], logical axes)}} of the base kernels, as the model declares them."""
    declared = declared_params(config)
    shapes, axes = declared.shapes["params"], declared.axes["params"]
    return {f"layers_{i}": {t: (shapes[f"layers_{i}"][t]["kernel"].shape, axes[f"layers_{i}"][t]["kernel"])
                            for t in TARGETS} for i in range(config.num_layers)}


def lora_axes(config: ModelConfig) -> dict:
    """The buffers' logical axes: {"layers_i": {target: {"a": P, "b": P}}}, from each base kernel's [in, out]."""
    return {layer: {t: _axes(axes) for t, (_, axes) in targets.items()} for layer, targets in _kernels(config).items()}


def _axes(kernel: P) -> dict:
    k_in, k_out = kernel
    return {"a": P(None, k_in, None), "b": P(None, None, k_out)}


def lora_shapes(config: ModelConfig, max_loras: int, max_lora_rank: int) -> dict:
    """The buffers' shapes, a tree like `lora_axes`'."""
    N, R = max_loras, max_lora_rank
    return {layer: {t: {"a": (N, n_in, R), "b": (N, R, n_out)} for t, ((n_in, n_out), _) in targets.items()}
            for layer, targets in _kernels(config).items()}


def lora_bytes(config: ModelConfig, max_loras: int, max_lora_rank: int, dtype) -> int:
    """The buffers' bytes in all (a tensor-parallel mesh splits each buffer's larger half over its devices)."""
    return sum((int(np.prod(ab["a"])) + int(np.prod(ab["b"]))) * jnp.dtype(dtype).itemsize
               for targets in lora_shapes(config, max_loras, max_lora_rank).values() for ab in targets.values())


def empty_lora(config: ModelConfig, max_loras: int, max_lora_rank: int, dtype) -> dict:
    """Zero buffers (every slot empty), as jnp arrays on the default device."""
    return {layer: {t: {k: jnp.zeros(shape, dtype) for k, shape in ab.items()} for t, ab in targets.items()}
            for layer, targets in lora_shapes(config, max_loras, max_lora_rank).items()}


def slot_arrays(adapter: LoRAAdapter | None, config: ModelConfig, max_lora_rank: int, dtype) -> dict:
    """One slot's contents as host arrays, a tree like the buffers' without their slot axis: the adapter's A and B
    zero-padded to max_lora_rank (None: all zeros, an empty slot). config: the runner's, whose KV heads may be
    repeated for tensor parallelism (`jaxserve.model.decoder.repeat_kv_heads`): k and v's B are repeated alike."""
    if adapter is not None and adapter.rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank {max_lora_rank}")
    out = {}
    for layer, targets in lora_shapes(config, 1, max_lora_rank).items():
        i = int(layer.removeprefix("layers_"))
        out[layer] = {}
        for t, shapes in targets.items():
            a = np.zeros(shapes["a"][1:], dtype)  # [in, R]
            b = np.zeros(shapes["b"][1:], dtype)  # [R, out]
            if adapter is not None and (i, t) in adapter.weights:
                wa, wb = adapter.weights[i, t]  # [in, r], [r, out]
                if t in ("k_proj", "v_proj") and b.shape[1] != wb.shape[1] and not b.shape[1] % wb.shape[1]:
                    # KV heads repeated over a mesh wider than them
                    wb = repeat_heads(wb, config.head_dim, b.shape[1] // wb.shape[1])
                if wa.shape[0] != a.shape[0] or wb.shape[1] != b.shape[1]:
                    raise ValueError(f"LoRA adapter {adapter.name!r}: layer {i} {t}'s [{wa.shape[0]}, "
                                     f"{wb.shape[1]}] does not fit the model's {a.shape[0], b.shape[1]}")
                r = wa.shape[1]
                a[:, :r] = wa
                b[:r] = wb
            out[layer][t] = {"a": a, "b": b}
    return out


class SlotArrays:
    """The padded host arrays (`slot_arrays`) of adapters for one runner's layout, built ahead of the slot write.

    Padding an adapter to max_lora_rank takes a while (16 ms for the default model's, ~80 MB for Llama-3-8B at rank
    16): `prepare` builds them where the adapter is loaded (the thread that checks a request or adds an adapter, off
    the engine's), and the engine thread's slot write only reads them (`get`), building them itself only for an
    adapter nobody prepared. Entries live as long as their adapter object (held weakly): while the host holds it or
    a sequence runs on it. Thread-safe."""

    def __init__(self, config: ModelConfig, max_lora_rank: int, dtype):
        self.config, self.max_lora_rank, self.dtype = config, max_lora_rank, dtype
        self._built: dict[int, dict] = {}  # id(adapter) -> its arrays, dropped when the adapter is
        self._lock = threading.Lock()
        self._empty: dict | None = None
        self.built_on_demand = 0  # adapters `get` had to build: none prepared them

    def prepare(self, adapter: LoRAAdapter) -> None:
        """Builds the adapter's arrays unless built (ValueError if it does not fit, as slot_arrays)."""
        with self._lock:
            if id(adapter) in self._built:
                return
        arrays = slot_arrays(adapter, self.config, self.max_lora_rank, self.dtype)  # outside the lock: the slow part
        with self._lock:
            if id(adapter) not in self._built:
                self._built[id(adapter)] = arrays
                weakref.finalize(adapter, self._forget, id(adapter))

    def get(self, adapter: LoRAAdapter | None) -> dict:
        """The adapter's arrays (None: an empty slot's zeros), built now if nobody prepared them."""
        if adapter is None:
            if self._empty is None:
                self._empty = slot_arrays(None, self.config, self.max_lora_rank, self.dtype)
            return self._empty
        with self._lock:
            arrays = self._built.get(id(adapter))
        if arrays is None:
            self.built_on_demand += 1
            self.prepare(adapter)
            with self._lock:
                arrays = self._built[id(adapter)]
        return arrays

    def _forget(self, key: int) -> None:
        with self._lock:
            self._built.pop(key, None)
