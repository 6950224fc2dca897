"""Weight-only quantization as pytree nodes: int8 with a scale per output channel, int4 with a scale per group of
input rows per output channel, two values packed per byte.

A quantized weight replaces its float kernel in the params pytree, so params stay a plain pytree (jit, donation,
sharding and checkpoints see arrays). `matmul` takes any kind. Decode reads every weight once per step, so fewer
bytes per weight is a direct cut in what bounds its speed.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

QUANTIZATIONS = (None, "int8", "int4")
INT4_GROUP_SIZE = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    values: jax.Array  # int8 [in, out]
    scale: jax.Array  # float32 [out]: weight ~= values * scale

    @property
    def shape(self):
        return self.values.shape


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scale"], meta_fields=["in_features"])
@dataclasses.dataclass
class Int4Weight:
    packed: jax.Array  # uint8 [in_padded / 2, out]: input rows 2i (low nibble) and 2i+1 (high), offset by 8
    scale: jax.Array  # float32 [in_padded / group, out]: weight ~= value * scale of its group
    in_features: int  # rows before padding to a whole number of groups

    @property
    def shape(self):
        return (self.in_features, self.packed.shape[1])

    def dequantize(self, dtype) -> jax.Array:
        q = jnp.stack([self.packed & 15, self.packed >> 4], axis=1).reshape(-1, self.packed.shape[1])  # [in_p, out]
        groups = self.scale.shape[0]
        w = (q.astype(dtype) - 8).reshape(groups, -1, q.shape[1]) * self.scale[:, None, :].astype(dtype)
        return w.reshape(-1, q.shape[1])[:self.in_features]


def quantize_int4(w: jax.Array, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Symmetric per (group of `group_size` input rows, output channel): values -8..7, |w| max of a group -> 7.
    Input rows are zero-padded to whole groups (SmolLM2's 576 is 4.5 groups of 128)."""
    n_in, n_out = w.shape
    padded = -(-n_in // group_size) * group_size
    w32 = jnp.pad(w.astype(jnp.float32), ((0, padded - n_in), (0, 0))).reshape(-1, group_size, n_out)
    scale = jnp.max(jnp.abs(w32), axis=1) / 7.0  # [groups, out]
    scale = jnp.where(scale > 0, scale, 1.0)
    q = (jnp.clip(jnp.round(w32 / scale[:, None, :]), -8, 7) + 8).astype(jnp.uint8).reshape(padded, n_out)
    return Int4Weight(q[0::2] | (q[1::2] << 4), scale, n_in)


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
    if isinstance(w, Int4Weight):
        return x @ w.dequantize(x.dtype)
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
                out[key] = quantize_int8(value) if method == "int8" else quantize_int4(value)
            else:
                out[key] = value
        return out
    return walk(params, "")
