"""The layers every family shares: a linear layer over float or quantized kernels, and RMSNorm."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.quant import matmul


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        # kernel: [in, out], float or quantized (jaxserve.quant). A quantized kernel's leaves do not have the float
        # kernel's shape, so an existing kernel is read as is rather than through param()'s shape check.
        if self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")
        else:
            kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.dtype)
        y = matmul(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32. Gemma's x * (1 + w) is this with the 1 added at load (jaxserve.model.families)."""
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return (x32 * weight.astype(jnp.float32)).astype(self.dtype)
