"""Weight-only quantization: int8 values with a float scale per output channel, as a pytree node.

A quantized weight replaces its float kernel in the params pytree, so params stay a plain pytree (jit, donation,
sharding and checkpoints see two arrays). `matmul` takes either kind. Decode reads every weight once per step, so
a quarter of the bytes (int8 against float32) is a direct cut in what bounds its speed.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

QUANTIZATIONS = (None, "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    values: jax.Array  # int8 [in, out]
    scale: jax.Array  # float32 [out]: weight ~= values * scale

    @property
    def shape(self):
        return self.values.shape


def quantize_int8(w: jax.Array) -> Int8Weight:
    """Symmetric, per output channel (a column of the [in, out] kernel): its largest |w| maps to 127."""
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return Int8Weight(jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8), scale)


def matmul(x, w):
    """x @ w for a float kernel or an Int8Weight (the scale applies to the output columns, after the sum)."""
    if isinstance(w, Int8Weight):
        return (x @ w.values.astype(x.dtype)) * w.scale.astype(x.dtype)
    return x @ w


def quantize_params(params: dict, method: str | None, quantize_lm_head: bool = False) -> dict:
    """Every linear layer's kernel quantized (the LM head only if asked); norms and embeddings stay as they are."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {method!r}")
    if method is None:
        return params

    def walk(tree: dict, module: str) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = walk(value, key)
            elif key == "kernel" and (module != "lm_head" or quantize_lm_head):
                out[key] = quantize_int8(value)
            else:
                out[key] = value
        return out
    return walk(params, "")
