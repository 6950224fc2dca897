"""x @ w with few rows on CPU (decode steps) by the kernel in few_row_matmul.cc: float32, bfloat16 and int8 weights
(an int8 weight is dequantized exactly, with its per-column scale, in registers).

Rows through every weight the default model serves, chained as in a step, each product's output normalized into
the next (SmolLM2-135M: 538 MB float32; 2 vCPU AMD EPYC with AVX-512-BF16, 2026-12-06, busy host, median of 9,
the two interleaved), ms for XLA:CPU's lowering (float32 dot; bf16 dot padded to 8 rows; int8 x int8 two-digit dot)
/ this kernel:
  rows           1              2              4              8
  float32   17.4 / 16.4    22.8 / 17.6    24.4 / 19.8    27.3 / (27.2)
  bfloat16  16.2 /  9.1    16.0 /  9.5    19.2 / 10.8    16.5 / 15.4
  int8      11.3 /  6.2    13.3 /  7.9    16.6 /  9.4    20.2 / 15.0
so the kernel up to MAX_ROWS rows by format (float32 at 8 rows and every format at 16 were level). bf16 and int8
one-row dots were XLA:CPU compute loops, reading 16-19 GB/s; the kernel streams them at 30-35 GB/s on a quiet host,
float32 at 40-43, about what the machine gives one process.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.cpu_kernels import build

MAX_ROWS = {"float32": 4, "bfloat16": 8, "int8": 8}  # the most rows (the table above) and the kernel's limit
FLOAT_TARGET, INT8_TARGET = "jaxserve_float_matmul", "jaxserve_int8_matmul"


def _registered() -> None:
    if not available():
        raise RuntimeError("the CPU kernels are switched off or could not be built (see the jaxserve log)")


def available() -> bool:
    """The kernel is built and registered with XLA:CPU (False where it cannot be built, or is switched off)."""
    return build.register("few_row_matmul.cc", ((FLOAT_TARGET, "JaxserveFloatMatmul"),
                                                (INT8_TARGET, "JaxserveInt8Matmul")))


def check_operands(x, w, w_dtypes: tuple[str, ...], scale=None) -> None:
    """ValueError naming the operand that does not go with the others (the kernel checks them too, but XLA reports
    its refusal without the operand's name, and at run time)."""
    if len(x.shape) < 1:
        raise ValueError(f"few-row matmul: x must be [..., in], got a scalar {x.shape}")
    if len(w.shape) != 2 or w.shape[0] != x.shape[-1] or jnp.dtype(w.dtype).name not in w_dtypes:
        raise ValueError(f"few-row matmul: the weight must be {'/'.join(w_dtypes)} [in = {x.shape[-1]}, out], got "
                         f"{w.dtype} {w.shape}")
    if scale is not None and tuple(scale.shape) != (w.shape[1],):
        raise ValueError(f"few-row matmul: scale must be [out] = [{w.shape[1]}], got {scale.shape}")


def _rows(x):
    """x [..., in] as float32 rows [M, in], or None where it has none (0 rows: the product is empty)."""
    m = math.prod(x.shape[:-1])
    return None if m == 0 else x.reshape(m, x.shape[-1]).astype(jnp.float32)  # [M, in]


def float_matmul(x, kernel):
    """x [..., in] @ kernel [in, out] (float32 or bfloat16) -> [..., out] in x's dtype, float32 arithmetic."""
    _registered()
    check_operands(x, kernel, ("float32", "bfloat16"))
    if (rows := _rows(x)) is None:
        return jnp.zeros((*x.shape[:-1], kernel.shape[1]), x.dtype)
    out = jax.ffi.ffi_call(FLOAT_TARGET, jax.ShapeDtypeStruct((rows.shape[0], kernel.shape[1]), jnp.float32))(
        rows, kernel)  # [M, out]
    return out.astype(x.dtype).reshape(*x.shape[:-1], -1)


def int8_matmul(x, values, scale):
    """x [..., in] @ (values [in, out] int8 * scale [out]) -> [..., out] in x's dtype, float32 arithmetic."""
    _registered()
    check_operands(x, values, ("int8",), scale)
    if (rows := _rows(x)) is None:
        return jnp.zeros((*x.shape[:-1], values.shape[1]), x.dtype)
    out = jax.ffi.ffi_call(INT8_TARGET, jax.ShapeDtypeStruct((rows.shape[0], values.shape[1]), jnp.float32))(
        rows, values, scale.astype(jnp.float32))  # [M, out]
    return out.astype(x.dtype).reshape(*x.shape[:-1], -1)
