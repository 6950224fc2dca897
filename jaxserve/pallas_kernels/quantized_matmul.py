"""Weight-only int4 matmul for decode-sized activations: the packed weights cross HBM as int4 and are dequantized
in registers (GPU) or VMEM (TPU), a block at a time, right before the dot. `jaxserve.model.quant.matmul` runs them on
those platforms.

Decode reads every weight once per step for a handful of activation rows, so its time is bytes / bandwidth: int4
(with an f16 scale and offset per group) is about a quarter of bf16's bytes, if the dequantization never writes a
full-precision copy back to HBM, which XLA's `x @ dequantize(w)` does on both TPU and GPU (the deviceless compiles'
HBM audit, BENCHMARKS.md issue 24). int8 needs no kernel: XLA keeps an int8 weight as s8 into its dot on both.

Written for Pallas' Triton lowering (see ragged_attention.py for why not Mosaic GPU yet). One program per (block of
N, block of M rows, split of K) walks its K range with a `fori_loop`, accumulating in float32. Decode's M (1..256)
is padded to a power of two >= 16 (Triton's dot needs >= 16 in each dimension); with so few rows a GPU has only
N / block_n programs to run, so K is split (`split_k`, chosen to give about two programs per SM on large GPUs) and
the float32 partial sums are added outside the kernel. Block sizes are fitted to divide the shapes (the Triton
lowering has no masked edge blocks here), so real model shapes never copy their weights; only an N that is not a
multiple of 16 is padded, weights included, per call (a slow path no real model takes). `int4_matmul_tpu` is the
same contract for TPU (Pallas Mosaic), at the end of this file.

Every kernel has its `jax.numpy` reference beside it: the oracle in the tests (which run the kernels in Pallas
interpret mode on CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.pallas_kernels.matmul_parts import lane_block, matmul_dot, matmul_precision
from jaxserve.pallas_kernels.softmax import pow2

TARGET_PROGRAMS = 256  # ~2 per SM on an H100/H200 (132 SMs): what split_k=None aims for
MAX_SPLIT_K = 8


def _fit(n: int, block: int, lo: int = 16) -> tuple[int, int]:
    """(block, padded n): the largest power of two <= block dividing n, at least lo (n padded up when none is)."""
    padded = n if n % lo == 0 else -(-n // lo) * lo
    b = lo
    while b * 2 <= block and padded % (b * 2) == 0:
        b *= 2
    return b, padded


def _split_k(steps: int, programs: int, split_k: int | None) -> int:
    """How many ways to split `steps` K steps: split_k as given (it must divide them), or the smallest divisor that
    brings the grid to TARGET_PROGRAMS (at most MAX_SPLIT_K)."""
    if split_k is not None:
        if steps % split_k:
            raise ValueError(f"split_k={split_k} does not divide the {steps} K steps")
        return split_k
    split = 1
    for d in range(1, min(steps, MAX_SPLIT_K) + 1):
        if steps % d == 0:
            split = d
            if programs * d >= TARGET_PROGRAMS:
                break
    return split


def _rows(M: int, max_block_m: int) -> tuple[int, int]:
    """(block_m, padded M): a power of two >= 16 (the dot's minimum) up to max_block_m."""
    block_m = min(pow2(M, 16), max_block_m)
    return block_m, -(-M // block_m) * block_m


def _int4_shapes(x, packed, scale, offset, group_size):
    (M, K), (half_k, N) = x.shape, packed.shape
    groups = K // group_size if group_size else 0
    if (group_size < 32 or group_size % 2 or K % group_size or 2 * half_k != K
            or scale.shape != (groups, N) or offset.shape != (groups, N)):
        raise ValueError(f"int4_matmul: x {x.shape} (padded to the group size), packed {packed.shape}, scale "
                         f"{scale.shape}, offset {offset.shape}, group_size {group_size} do not agree")
    return M, K, N, groups


def _int4_kernel(xe_ref, xo_ref, p_ref, s_ref, z_ref, o_ref, *, group_size, groups_per_step, precision):
    # xe_ref, xo_ref [block_m, K / 2 / split]: x's even and odd columns; p_ref uint8 [K / 2 / split, block_n];
    # s_ref, z_ref float16 [groups / split, block_n]; o_ref [block_m, block_n]
    dtype = xe_ref.dtype
    half = group_size // 2  # packed rows per group

    def step(t, acc):
        for u in range(groups_per_step):  # unrolled: one group (one scale and offset row) at a time
            g = t * groups_per_step + u
            rows = pl.ds(pl.multiple_of(g * half, half), half)
            packed = p_ref[rows, :].astype(jnp.int32)
            s = s_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, block_n], broadcast over the group's rows
            z = z_ref[pl.ds(g, 1), :].astype(jnp.float32)
            low = ((packed & 15).astype(jnp.float32) * s + z).astype(dtype)  # input rows 2i
            high = ((packed >> 4).astype(jnp.float32) * s + z).astype(dtype)  # input rows 2i + 1
            acc = acc + matmul_dot(xe_ref[:, rows], low, precision) + matmul_dot(xo_ref[:, rows], high, precision)
        return acc

    steps = s_ref.shape[0] // groups_per_step
    o_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "block_n", "block_k", "max_block_m", "split_k",
                                             "num_warps", "num_stages", "interpret"))
def int4_matmul(x, packed, scale, offset, *, group_size, block_n=128, block_k=256, max_block_m=64, split_k=None,
                num_warps=4, num_stages=3, interpret=False):
    """x @ W in x's dtype, accumulated in float32, for group-wise int4 weights W [K_pad, N]:

        W[k, n] = q[k, n] * scale[k // group_size, n] + offset[k // group_size, n],  q in 0..15,

    with q[2i, n] the low nibble and q[2i + 1, n] the high nibble of packed[i, n].
    x [M, K_pad] float32 or bfloat16, ALREADY zero-padded to K_pad = ceil(K / group_size) * group_size columns (the
    padding rows of W are arbitrary, so x's padding must be zero); packed uint8 [K_pad / 2, N]; scale, offset
    float16 [K_pad / group_size, N]; group_size 32, 64 or 128 (any even size >= 32 lowers).
    block_k: upper bound on the K rows per loop step (whole groups; fitted to divide the groups); block_n: upper
    bound (fitted to divide N); split_k: K splits (None: enough programs to fill a GPU); interpret: Pallas interpret
    mode (CPU tests).
    """
    M, K, N, groups = _int4_shapes(x, packed, scale, offset, group_size)
    block_m, Mp = _rows(M, max_block_m)
    block_n, Np = _fit(N, block_n)
    groups_per_step = max(d for d in range(1, max(block_k // group_size, 1) + 1) if groups % d == 0)
    x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    xe, xo = x[:, 0::2], x[:, 1::2]  # [Mp, K / 2]: the columns meeting low and high nibbles (x is small)
    if Np != N:  # slow path, no real model: the weights are copied
        packed = jnp.pad(packed, ((0, 0), (0, Np - N)))
        scale, offset = (jnp.pad(a, ((0, 0), (0, Np - N))) for a in (scale, offset))
    programs = (Np // block_n) * (Mp // block_m)
    split = _split_k(groups // groups_per_step, programs, split_k)
    Gs = groups // split  # groups per split
    Hs = Gs * group_size // 2  # packed rows per split
    out = pl.pallas_call(
        functools.partial(_int4_kernel, group_size=group_size, groups_per_step=groups_per_step,
                          precision=matmul_precision(x.dtype)),
        grid=(Np // block_n, Mp // block_m, split),
        in_specs=[pl.BlockSpec((block_m, Hs), lambda j, i, s: (i, s)),
                  pl.BlockSpec((block_m, Hs), lambda j, i, s: (i, s)),
                  pl.BlockSpec((Hs, block_n), lambda j, i, s: (s, j)),
                  pl.BlockSpec((Gs, block_n), lambda j, i, s: (s, j)),
                  pl.BlockSpec((Gs, block_n), lambda j, i, s: (s, j))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda j, i, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split, Mp, Np), x.dtype if split == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int4_matmul",
    )(xe, xo, packed, scale.astype(jnp.float16), offset.astype(jnp.float16))
    return out.sum(axis=0).astype(x.dtype)[:M, :N]


def int4_dequantize(packed, scale, offset, group_size, dtype=jnp.float32):
    """The int4 weights W [K_pad, N] in `dtype` (computed in float32)."""
    q = jnp.stack([packed & 15, packed >> 4], axis=1).reshape(-1, packed.shape[1]).astype(jnp.float32)
    s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=0)
    z = jnp.repeat(offset.astype(jnp.float32), group_size, axis=0)
    return (q * s + z).astype(dtype)


def int4_matmul_reference(x, packed, scale, offset, *, group_size):
    """The same function, directly: dequantize all of W in float32, then a float32 matmul."""
    w = int4_dequantize(packed, scale, offset, group_size)
    return jnp.matmul(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


# TPU (Pallas Mosaic): the same contract. The grid is (block of N, block of M, block of K) with K sequential
# ("arbitrary") and a float32 accumulator in VMEM scratch; BlockSpecs pipeline the weight blocks HBM -> VMEM, where
# they are widened and dequantized before the MXU dot. Blocks are multiples of (16, 128) that divide the shapes, or
# a whole dimension where none does (SmolLM2's 576), so no weight is ever copied.

def _tpu_rows(M: int, max_block_m: int) -> tuple[int, int]:
    block_m = min(-(-M // 16) * 16, max_block_m)  # 16: a bfloat16 sublane tile
    return block_m, -(-M // block_m) * block_m


def _tpu_params():
    from jax.experimental.pallas import tpu as pltpu
    return pltpu, pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _accumulate(acc_ref, product, finish):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _reset():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += product()
    pl.when(k == pl.num_programs(2) - 1)(finish)


def _tpu_matmul_call(kernel, k_steps, in_specs, Mp, N, block_m, block_n, dtype, name, interpret):
    """A pallas_call over (N blocks, M blocks, K steps) with a float32 VMEM accumulator, [Mp, N] out in dtype."""
    pltpu, params = _tpu_params()
    return pl.pallas_call(
        kernel,
        grid=(N // block_n, Mp // block_m, k_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda j, i, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name=name,
    )


def _float16_bits_to_float32(bits):
    """float16 values from their bits (int16, sign-extended to int32) as float32, exactly (finite values): Mosaic
    cannot load float16 vectors on v5e ("Invalid vector type for load"), int16 it can."""
    bits = bits & 0xFFFF
    sign, exponent, mantissa = (bits & 0x8000) << 16, (bits >> 10) & 0x1F, bits & 0x3FF
    normal = jax.lax.bitcast_convert_type(sign | ((exponent + 112) << 23) | (mantissa << 13), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * 2.0 ** -24  # and zero
    return jnp.where(exponent == 0, jnp.where(sign != 0, -subnormal, subnormal), normal)


def _int4_tpu_kernel(xe_ref, xo_ref, p_ref, s_ref, z_ref, o_ref, acc_ref, *, group_size, precision):
    # xe_ref, xo_ref [block_m, block_k / 2]; p_ref uint8 [block_k / 2, block_n];
    # s_ref, z_ref int16 (float16 bits) [block_k / group_size, block_n]
    def product():
        dtype = xe_ref.dtype
        packed = p_ref[...].astype(jnp.int32)
        # one row per packed row
        s = jnp.repeat(_float16_bits_to_float32(s_ref[...].astype(jnp.int32)), group_size // 2, axis=0)
        z = jnp.repeat(_float16_bits_to_float32(z_ref[...].astype(jnp.int32)), group_size // 2, axis=0)
        low = ((packed & 15).astype(jnp.float32) * s + z).astype(dtype)
        high = ((packed >> 4).astype(jnp.float32) * s + z).astype(dtype)
        return matmul_dot(xe_ref[...], low, precision) + matmul_dot(xo_ref[...], high, precision)

    def finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    _accumulate(acc_ref, product, finish)


@functools.partial(jax.jit, static_argnames=("group_size", "block_n", "block_k", "max_block_m", "interpret"))
def int4_matmul_tpu(x, packed, scale, offset, *, group_size, block_n=256, block_k=1024, max_block_m=256,
                    interpret=False):
    """Arguments and result as `int4_matmul` (x [M, K_pad] already zero-padded to K_pad columns -> [M, N])."""
    M, K, N, groups = _int4_shapes(x, packed, scale, offset, group_size)
    block_m, Mp = _tpu_rows(M, max_block_m)
    block_n = lane_block(N, block_n)
    # Groups a step: a multiple of 16 (scale and offset's float16 sublane tile; 16 groups are >= 256 packed
    # columns of x, whole lane tiles) dividing the groups, else all of them.
    block_g = next((g for g in range(max(block_k // group_size, 16) // 16 * 16, 0, -16) if groups % g == 0), groups)
    rows = block_g * group_size // 2
    x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    kernel = functools.partial(_int4_tpu_kernel, group_size=group_size, precision=matmul_precision(x.dtype))
    call = _tpu_matmul_call(
        kernel, groups // block_g,
        [pl.BlockSpec((block_m, rows), lambda j, i, k: (i, k)),
         pl.BlockSpec((block_m, rows), lambda j, i, k: (i, k)),
         pl.BlockSpec((rows, block_n), lambda j, i, k: (k, j)),
         pl.BlockSpec((block_g, block_n), lambda j, i, k: (k, j)),
         pl.BlockSpec((block_g, block_n), lambda j, i, k: (k, j))],
        Mp, N, block_m, block_n, x.dtype, "int4_matmul_tpu", interpret)
    # float16 as its bits: a view of the same bytes (a bitcast of the packed bytes to int8 would be a copy)
    bits = [jax.lax.bitcast_convert_type(a.astype(jnp.float16), jnp.int16) for a in (scale, offset)]
    out = call(x[:, 0::2], x[:, 1::2], packed, *bits)
    return out[:M]
