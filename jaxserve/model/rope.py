"""Rotary position embeddings (HF rotate-half convention), with Llama-3 and linear scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling) -> np.ndarray:
    """scaling: HF rope_scaling as a dict or its items."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [head_dim / 2]
    if not scaling:
        return inv_freq.astype(np.float32)
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling["factor"]
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended smoothly.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = np.where(wavelen > old_ctx / low, inv_freq / factor,
                       np.where(wavelen < old_ctx / high, inv_freq, blended))
        return out.astype(np.float32)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def apply_rope(x, positions, inv_freq):
    """x: [..., heads, head_dim]; positions: [...]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., head_dim / 2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
