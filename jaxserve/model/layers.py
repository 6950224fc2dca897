"""The layers every family shares: a linear layer over float or quantized kernels, and RMSNorm.

Each parameter is made with the logical axes of its dimensions (`nn.with_logical_partitioning`): that declaration,
read back by `jaxserve.model.decoder.param_axes`, is how a tensor-parallel mesh splits it (`RULES` in
`jaxserve.parallel.mesh` maps logical axes to the mesh's).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.model.lora import lora_delta
from jaxserve.model.quant import matmul


class Linear(nn.Module):
    features: int
    axes: tuple[str, str]  # the logical axes of the kernel's [in, out], e.g. ("embed", "mlp")
    use_bias: bool = False
    dtype: Any = jnp.float32
    # False: the kernel is split over a tensor-parallel mesh, where `matmul` cannot use a Pallas kernel.
    whole: bool = True

    @nn.compact
    def __call__(self, x, lora_slot=None):
        """x: [T, in]. lora_slot: int32 [T], each token's adapter slot (-1: none), read with the "lora" collection's
        a [N, in, R] and b [N, R, out] if the layer has them (`jaxserve.lora.buffers`)."""
        # kernel: [in, out], float or quantized (jaxserve.model.quant). A quantized kernel's leaves do not have the
        # float kernel's shape, so an existing kernel is read as is rather than through param()'s shape check.
        if self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")
        else:
            init = nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes)
            kernel = self.param("kernel", init, (x.shape[-1], self.features), self.dtype)
        y = matmul(x, kernel, kernels=self.whole)
        if self.use_bias:  # [out]: split as the kernel's outputs are
            init = nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:])
            y = y + self.param("bias", init, (self.features,), self.dtype)
        if lora_slot is not None and self.has_variable("lora", "a"):  # after the bias, as PEFT adds it
            y = with_lora(y, x, [(self.get_variable("lora", "a"), self.get_variable("lora", "b"))], lora_slot,
                          self.whole)
        return y


def with_lora(y, x, adapters: list, lora_slot, kernels: bool = True):
    """y [T, out] plus the LoRA term of x [T, in] on each token's slot: adapters, the (a [N, in, R], b [N, R, o])
    buffers of the targets whose outputs y holds in turn (one, or a fused projection's q/k/v or gate/up:
    `jaxserve.model.fused`)."""
    delta = jnp.concatenate([lora_delta(x, a, b, lora_slot, kernels=kernels) for a, b in adapters], axis=-1)
    # A base token keeps the base output bit for bit: selected, not y + 0, which XLA may fold into the matmul's
    # accumulation (C += A @ B rounds differently).
    return jnp.where(lora_slot[:, None] >= 0, y + delta, y)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32. Gemma's x * (1 + w) is this with the 1 added at load
    (jaxserve.model.families)."""
    eps: float
    dtype: Any = jnp.float32
    axis: str = "embed"  # the logical axis of the normalised dimension ("head_dim" for a per-head norm)

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.ones, (self.axis,))
        return rms_norm(x, self.param("weight", init, (x.shape[-1],), self.dtype), self.eps, self.dtype)


def rms_norm(x, weight, eps: float, dtype):
    """RMSNorm as a plain function of its weight (what the module computes)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    return (x32 * weight.astype(jnp.float32)).astype(dtype)
