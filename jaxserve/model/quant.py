"""Weight-only quantization as pytree nodes: int8 with a scale per output channel, int4 with a scale and an offset
per group of input rows per output channel (two values packed per byte), int8 embedding rows.

A quantized weight replaces its float kernel in the params pytree, so params stay a plain pytree (jit, donation,
sharding and checkpoints see arrays). `matmul` and `embed` take any kind. Decode reads every weight once per step,
so fewer bytes per weight is a direct cut in what bounds its speed.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.cpu_kernels import few_row_matmul
from jaxserve.pallas_kernels.quantized_matmul import int4_dequantize, int4_matmul, int4_matmul_tpu

# "awq" is int4 with activation-aware input scales (jaxserve.quantize.awq).
QUANTIZATIONS = (None, "int8", "int4", "awq")
# int4's default is llama.cpp's Q4_1 layout (groups of 32, f16 scale and minimum: 5 bits a weight), which the
# default model already ships in, so it costs that model nothing; groups of 128 (4.25 bits, AutoAWQ's default) cost
# it +150% perplexity plain and are what AWQ is for (BENCHMARKS.md, quality).
DEFAULT_GROUP_SIZE = {"int4": 32, "awq": 128}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    values: jax.Array  # int8 [in, out]
    scale: jax.Array  # float32 [out]: weight ~= values * scale

    def logical_axes(self, kernel: P) -> Int8Weight:
        """Each array's logical axes, from the float kernel's [in, out] ones: a tensor-parallel split of the kernel
        splits its quantized form the same way."""
        return Int8Weight(values=kernel, scale=P(kernel[1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight:
    packed: jax.Array  # uint8 [in_padded / 2, out]: input rows 2i (low nibble) and 2i+1 (high), values 0..15
    scale: jax.Array  # float16 [in_padded / group, out]
    offset: jax.Array  # float16 [in_padded / group, out]: weight ~= value * scale + offset of its group
    # float32 [in] or None. AWQ: the kernel holds W with salient input rows scaled up before rounding, so
    # x @ W ~= (x * input_scale) @ dequantize().
    input_scale: jax.Array | None = None

    def logical_axes(self, kernel: P) -> Int4Weight:
        """Each array's logical axes, from the float kernel's [in, out] ones: packed rows and groups are runs of
        input rows, so they split with the inputs (where their count divides; see jaxserve.parallel.mesh)."""
        return Int4Weight(packed=kernel, scale=kernel, offset=kernel,
                          input_scale=None if self.input_scale is None else P(kernel[0]))

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[0] // self.scale.shape[0]

    def dequantize(self, dtype) -> jax.Array:
        """[in_padded, out]: rows past the float kernel's are the zero padding of the last group."""
        return int4_dequantize(self.packed, self.scale, self.offset, self.group_size, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Rows:
    """An embedding table, int8 with a scale per row: a lookup reads only its rows."""
    values: jax.Array  # int8 [vocab, hidden]
    scale: jax.Array  # float32 [vocab]

    def logical_axes(self, table: P) -> Int8Rows:
        """Each array's logical axes, from the float table's [vocab, hidden] ones."""
        return Int8Rows(values=table, scale=P(table[0]))


def quantize_int8(w: jax.Array) -> Int8Weight:
    """Symmetric, per output channel (a column of the [in, out] kernel): its largest |w| maps to 127."""
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return Int8Weight(jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8), scale)


def quantize_int4(w: jax.Array, group_size: int = DEFAULT_GROUP_SIZE["int4"],
                  input_scale: jax.Array | None = None) -> Int4Weight:
    """Asymmetric per (group of `group_size` input rows, output channel): the group's minimum -> 0, maximum -> 15.
    With input_scale, W / input_scale (per input row) is what gets rounded. Input rows are zero-padded to whole
    groups (SmolLM2's 576 is 4.5 groups of 128)."""
    n_in, n_out = w.shape
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group size must be an even number >= 2, got {group_size!r}")
    w32 = w.astype(jnp.float32)
    if input_scale is not None:
        w32 = w32 / input_scale[:, None]
    padded = -(-n_in // group_size) * group_size
    w32 = jnp.pad(w32, ((0, padded - n_in), (0, 0))).reshape(-1, group_size, n_out)
    lo, hi = jnp.min(w32, axis=1), jnp.max(w32, axis=1)  # [groups, out]
    # Rounded with the float16 scale and offset it will be read back with.
    scale, offset = ((hi - lo) / 15).astype(jnp.float16), lo.astype(jnp.float16)
    step = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    q = jnp.clip(jnp.round((w32 - offset.astype(jnp.float32)[:, None]) / step[:, None]), 0, 15)
    q = q.astype(jnp.uint8).reshape(padded, n_out)
    return Int4Weight(q[0::2] | (q[1::2] << 4), scale, offset, input_scale)


def quantize_rows_int8(table: jax.Array) -> Int8Rows:
    w32 = table.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return Int8Rows(jnp.clip(jnp.round(w32 / scale[:, None]), -127, 127).astype(jnp.int8), scale)


def matmul(x, w, *, kernels: bool = True):
    """x @ w for a float kernel [in, out] or a quantized one (float32 accumulation either way on x's dtype).

    On TPU and GPU an int4 weight goes through the Pallas int4 matmul, which unpacks a block at a time in VMEM or
    registers: left to XLA, `x @ dequantize(w)` writes a float copy of the whole weight to HBM first, every step
    (BENCHMARKS.md, issue 24); above KERNEL_MAX_ROWS rows (prefill) XLA's path. int8 and float weights stay with
    XLA, which keeps int8 as s8 into its dot on both; on GPU a one-row product gets a second, zero row
    (`_gpu_matmul`). On CPU a few rows (decode) go through a hand-written kernel, more rows through XLA's program
    with an int8 weight taking int8 activations and bf16 float32 accumulation (`_cpu_matmul`).
    kernels=False: the weight is split over a tensor-parallel mesh, which a Pallas or FFI call cannot take (the
    partitioner would gather it whole onto every device), so XLA's path there.
    """
    return jax.lax.platform_dependent(x, w, tpu=functools.partial(_tpu_matmul, kernels),
                                      cuda=functools.partial(_gpu_matmul, kernels),
                                      cpu=functools.partial(_cpu_matmul, kernels), default=_xla_matmul)


def _cpu_matmul(kernels, x, w):
    """Up to few_row_matmul.MAX_ROWS rows (decode) a float32, bf16 or int8 weight goes through the FFI kernel
    of jaxserve.cpu_kernels.few_row_matmul, which streams it at the machine's read rate (its docstring has the
    figures). Otherwise an int8 weight multiplies int8 activations (`int8_dot_matmul`, two digits): XLA:CPU converts a
    weight-only int8 kernel to a float copy before its dot, every call. scripts/bench_formats.py (Sapphire Rapids
    2 vCPU, 2026-12-02, best of 5, shared machine), us per matmul, weight-only int8 / two-digit int8 dot / float32:
      576x1536 (gate, up)  M=1 958 / 91 / 136    M=64 1761 / 510 / 1044    M=512 4221 / 2790 / 2965
      576x49152 (LM head)  M=1 50093 / 4681 / 7919    M=64 45334 / 12351 / 17322    M=512 180655 / 121392 / 126875
    so the integer dot at every row count (no threshold), and int8 decodes faster than float32 at batch 1 and 64.
    TPU and GPU keep weight-only int8, which their compilers read as s8 into the dot.
    bfloat16 activations with bf16 (or int4) weights go through `bf16_dot_matmul`."""
    fmt = _few_row_format(w)
    if kernels and fmt is not None and x.size // x.shape[-1] <= few_row_matmul.MAX_ROWS[fmt] \
            and few_row_matmul.available():
        if isinstance(w, Int8Weight):
            return few_row_matmul.int8_matmul(x, w.values, w.scale)
        return few_row_matmul.float_matmul(x, w)
    if isinstance(w, Int8Weight):
        return int8_dot_matmul(x, w)
    if x.dtype == jnp.bfloat16 and (isinstance(w, Int4Weight) or w.dtype == jnp.bfloat16):
        return bf16_dot_matmul(x, w)
    return _xla_matmul(x, w)


def _few_row_format(w) -> str | None:
    """w's key in few_row_matmul.MAX_ROWS, None for a weight the kernel does not take (int4, float16)."""
    if isinstance(w, Int8Weight):
        return "int8"
    dtype = getattr(w, "dtype", None)  # an int4 weight has none
    if dtype in (jnp.float32, jnp.bfloat16):
        return jnp.dtype(dtype).name
    return None


BF16_MIN_ROWS = 8  # the fewest rows a bf16 dot gets on CPU (`bf16_dot_matmul`)


def bf16_dot_matmul(x, w):
    """x @ w on XLA:CPU for bf16 x and a bf16 (or int4) weight: x [..., in] -> [..., out] bf16.

    XLA:CPU's fast bf16 kernel (AVX-512-BF16 / AMX) takes a bf16 x bf16 dot that accumulates into float32, from
    two rows up. A dot with a bf16 result (`x @ w`), or of one row, is a slow loop, slower than float32's.
    Interleaved, one process (Sapphire Rapids 2 vCPU, 2026-12-02, shared machine), us per matmul, float32 /
    bf16 result / float32 result:
      576x1536 (gate, up)  M=1 157 / 407 / 388    M=2 169 / 450 / 164    M=64 650 / 1246 / 245
                           M=512 6686 / 7642 / 1666
      576x49152 (LM head)  M=1 10248 / 53385 / 53405    M=2 13153 / 57133 / 13369    M=64 38610 / 91077 / 21906
    so float32 accumulation, and fewer than BF16_MIN_ROWS rows are padded with zero rows up to it: from one row,
    us per matmul with the weights out of cache (2026-12-02), zero rows up to 2 / 4 / 8 / 16 / 32, float32 unpadded:
      576x1536  105 / 92 / 87 / 97 / 124, 121      1536x576  139 / 115 / 107 / 114 / 120, 131
      576x49152 (LM head)  3066 / 2594 / 2602 / 2825 / 3664, 3852
    """
    x, kernel = _float_operands(x, w)
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    m = rows.shape[0]
    if m < BF16_MIN_ROWS:
        rows = jnp.pad(rows, ((0, BF16_MIN_ROWS - m), (0, 0)))  # [BF16_MIN_ROWS, in]
    out = jax.lax.dot_general(rows, kernel, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out[:m].astype(x.dtype).reshape(*x.shape[:-1], -1)  # [..., out]


def _float_operands(x, w):
    """(x, kernel) whose x @ kernel is x @ w for a float or int4 w: int4 dequantized to x's dtype, its input
    scale applied to x."""
    if isinstance(w, Int4Weight):
        if w.input_scale is not None:
            x = x * w.input_scale.astype(x.dtype)
        return x, w.dequantize(x.dtype)[:x.shape[-1]]
    return x, w


def _xla_matmul(x, w):
    if isinstance(w, Int8Weight):
        return (x @ w.values.astype(x.dtype)) * w.scale.astype(x.dtype)  # the scale is per output column
    x, kernel = _float_operands(x, w)
    return x @ kernel


def int8_dot_matmul(x, w: Int8Weight, digits: int = 2):
    """x @ w by XLA's int8 x int8 -> int32 dot: x [..., in] -> [..., out] in x's dtype.

    Each row of x is rounded to int8 with a scale from its largest |x| (dynamic, per token). One digit (w8a8) costs
    the default model +3.9% perplexity (25.36 -> 26.35 on tests/data/alice_ch1.txt), over int8's 1% bound: a
    token's outlier channels set its scale, and the rest round coarsely. With digits=2 the rounding's remainder is
    rounded again, on a 254x finer scale, as extra rows of the same dot: x ~= (q1 + q2 / 254) * scale, about 15 bits,
    so only the weights' rounding is left (as weight-only int8: 25.36 -> 25.44, +0.33%), and the weight is still
    read once.
    """
    if digits not in (1, 2):
        raise ValueError(f"digits must be 1 or 2, got {digits!r}")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [M, in]
    amax = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)  # [M, 1]
    scales = [jnp.where(amax > 0, amax / 127.0, 1.0)]
    q = jnp.clip(jnp.round(rows / scales[0]), -127, 127)  # [M, in]
    digit_rows = [q]
    if digits == 2:
        scales.append(scales[0] / 254.0)  # the remainder is at most half of scales[0]: q2 stays within +-127
        digit_rows.append(jnp.clip(jnp.round((rows - q * scales[0]) / scales[1]), -127, 127))
    m = rows.shape[0]
    q = jnp.concatenate(digit_rows).astype(jnp.int8)  # [digits * M, in]
    if q.shape[0] == 1:
        # XLA:CPU lowers a one-row integer dot to a slow loop (the 576x1536 kernel: 1.67 ms, float32's 0.26 ms)
        # and a two-row one to its GEMM (0.15 ms).
        q = _with_zero_row(q)
    acc = jax.lax.dot_general(q, w.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    out = sum(acc[i * m:(i + 1) * m].astype(jnp.float32) * scale for i, scale in enumerate(scales))  # [M, out]
    return (out * w.scale).astype(x.dtype).reshape(*x.shape[:-1], -1)


def _int4_kernel(kernel, x, w: Int4Weight):
    """x @ w by `kernel` (int4_matmul or int4_matmul_tpu): x [..., in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    if w.input_scale is not None:
        rows = rows * w.input_scale.astype(rows.dtype)
    rows = jnp.pad(rows, ((0, 0), (0, 2 * w.packed.shape[0] - rows.shape[1])))  # [M, in_padded]: zeros
    out = kernel(rows, w.packed, w.scale, w.offset, group_size=w.group_size)  # [M, out]
    return out.reshape(*x.shape[:-1], out.shape[-1])


# Rows up to which int4 goes through the kernels: decode steps, memory-bound. Their grids re-read (and unpack) each
# weight block once per block of rows (64 on GPU, 256 on TPU), so a long prefill chunk, compute-bound, does better
# with XLA's one dequantized copy and a full GEMM.
KERNEL_MAX_ROWS = 256


def _takes_kernel(x, w, kernels: bool) -> bool:
    return (kernels and isinstance(w, Int4Weight) and w.group_size >= 32  # the kernels' smallest group
            and x.size // x.shape[-1] <= KERNEL_MAX_ROWS)


def _tpu_matmul(kernels, x, w):
    return _int4_kernel(int4_matmul_tpu, x, w) if _takes_kernel(x, w, kernels) else _xla_matmul(x, w)


def _gpu_matmul(kernels, x, w):
    if _takes_kernel(x, w, kernels):
        return _int4_kernel(int4_matmul, x, w)
    if x.size != x.shape[-1]:
        return _xla_matmul(x, w)
    # One row: XLA:GPU strength-reduces a one-row dot of a small weight (operands under 10M elements) to a
    # multiply and a reduce, and writes the [in, out] product to HBM between the two (3x the weight's bytes). A
    # second, zero row keeps it a dot that reads the weight once.
    return _xla_matmul(_with_zero_row(x.reshape(1, -1)), w)[:1].reshape(*x.shape[:-1], -1)


def _with_zero_row(row):
    """[1, n] -> [2, n], the second row zeros: a one-row product that a compiler lowers badly becomes a two-row one
    (the callers say which and why); the caller keeps the first row of the result."""
    return jnp.concatenate([row, jnp.zeros_like(row)])


def embed(table, token_ids, dtype):
    """Rows of an embedding table [vocab, hidden], float or Int8Rows; returns [*token_ids.shape, hidden]."""
    if isinstance(table, Int8Rows):
        return (table.values[token_ids].astype(dtype) * table.scale[token_ids][..., None].astype(dtype))
    return table[token_ids]


def quantize_params(params: dict, method: str | None, *, quantize_embeddings: bool = False,
                    group_size: int | None = None, input_scales: dict | None = None) -> dict:
    """Every linear layer's kernel quantized; with quantize_embeddings also the LM head (same method) and the
    embedding table (int8 rows). Norms stay as they are.

    input_scales: {(module path, ...): float32 [in]} for "awq" (jaxserve.quantize.awq.find_input_scales), keyed by the
    path of the module holding the kernel, e.g. ("params", "layers_0", "q_proj").
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS[1:]} or None, got {method!r}")
    if method is None:
        return params
    if method == "awq" and input_scales is None:
        raise ValueError("awq quantization needs input scales from calibration (jaxserve.quantize.awq.quantize_awq)")
    group_size = group_size or DEFAULT_GROUP_SIZE.get(method)

    def quantize(kernel, path):
        if method == "int8":
            return quantize_int8(kernel)
        scale = input_scales.get(path) if input_scales is not None else None
        return quantize_int4(kernel, group_size, scale)

    def walk(tree: dict, path: tuple) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = walk(value, path + (key,))
            elif key == "kernel" and (path[-1] != "lm_head" or quantize_embeddings):
                out[key] = quantize(value, path)
            elif key == "embed_tokens" and quantize_embeddings:
                out[key] = quantize_rows_int8(value)
            else:
                out[key] = value
        return out
    return walk(params, ())


_NODES = {("scale", "values"): Int8Weight, ("offset", "packed", "scale"): Int4Weight,
          ("input_scale", "offset", "packed", "scale"): Int4Weight}


def restore_nodes(tree, row_tables=("embed_tokens",)):
    """A params tree read back as plain dicts (a checkpoint) -> with its quantized nodes rebuilt."""
    if not isinstance(tree, dict):
        return tree
    kind = _NODES.get(tuple(sorted(tree)))
    if kind is not None:
        return kind(**tree)
    return {key: (Int8Rows(**value) if key in row_tables and isinstance(value, dict) else restore_nodes(value))
            for key, value in tree.items()}


def is_quantized(x) -> bool:
    return isinstance(x, (Int8Weight, Int4Weight, Int8Rows))


def logical_axes(leaf, declared: P):
    """The logical axes of a params leaf that the model declared `declared` for its float form: the same, or, for a
    quantized weight, the tree of its arrays' axes (each kind derives them from the float kernel's)."""
    return leaf.logical_axes(declared) if is_quantized(leaf) else declared
