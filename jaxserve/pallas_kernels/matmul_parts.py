"""The pieces the Pallas matmul kernels (int4 weights: `quantized_matmul`; the LoRA term: `lora`) share: a
float32-accumulating dot at an explicit precision, that precision for an operand dtype, and TPU lane blocks. (Block
sizes that are powers of two: `softmax.pow2`.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_dot(x, w, precision):
    """x @ w accumulated in float32: [m, k] x [k, n] -> [m, n], operands in their dtypes."""
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def matmul_precision(dtype):
    """`matmul_dot`'s precision for operands of dtype."""
    # float32 operands: full-precision dots (the Triton lowering would otherwise use TF32); bf16: tensor cores.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def lane_block(n: int, block: int) -> int:
    """A block of a lane dimension: the largest multiple of 128 <= block dividing n, else all of n."""
    for b in range(block - block % 128, 0, -128):
        if n % b == 0:
            return b
    return n
