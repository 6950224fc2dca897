"""The multi-LoRA term as Pallas kernels, for GPU (Triton lowering; `lora_delta_gpu`) and TPU (Mosaic;
`lora_delta_tpu`), with the arguments and result of their jnp oracle `lora_delta_reference` (`reference`):

    x [T, in], a [N, in, R], b [N, R, out], slot [T] int32 -> [T, out] in x's dtype, float32 accumulation;
    row t = (x[t] @ a[slot[t]]) @ b[slot[t]], exactly 0 where slot[t] < 0.

Two halves, each a kernel: the shrink h = x @ A[slot] ([T, R] float32, tiny) and the expand h @ B[slot]. Tokens stay
in their step's order (no sort: permuting x and the output would move them twice more, 38 MB at a 512-token step of
Llama 3 8B's up projection against the 24 MB that step must move; XLA's sort + `ragged_dot` compiles to far more:
scripts/aot_lora.py). Instead the tokens go in blocks, and a block walks
the slots its tokens use (`slot_plan`, computed on device from `slot`: each block's distinct slots, ascending, and how
many), adding each slot's product under the mask of its tokens. A block therefore reads each adapter it uses once:
with a decode step in one block (T <= the block size) every used adapter is read once a step, however its rows mix
them; a prefill chunk's tokens are contiguous runs of one slot, so its blocks use one or two slots each. The compute
is the block's rows times the slots it uses (a masked product per slot), not times all N slots as a one-hot einsum's.

TPU: the slots are the grid's last axis, as many steps as the busiest block has slots (a run-time grid bound; the
plan scalar-prefetched: step s of block i reads A[plan[i, s]] / B[plan[i, s]]; a block's steps past its count
repeat its last slot, so Pallas' pipeline fetches nothing and the step is skipped). The shrink's grid is (token
block, K block of `in`, slot), its [T, R] float32 output resident in VMEM across K and slots; the expand's (token
block, N block of `out`, slot) with a float32 accumulator. A is read as [N, R, in] through a transpose that costs
nothing: XLA stores a [N, in, R] argument with `in` minor on TPU (a rank of 16 would fill 16 of 128 lanes), and a
kernel taking A as it is got the whole of A relaid out into VMEM before it, every call (deviceless v5e, HBM audit).
GPU: Triton programs cannot share an output across grid steps, so each program (token block, K split or N block)
loops over its block's slots (`fori_loop` to the count) and loads the slot's weights by index. Triton's dot wants
each dimension >= 16: ranks below 16 are zero-padded (a copy of A and B a call: set max_lora_rank >= 16 on GPU),
and a T that is not a multiple of the block pads x (a copy; serving's token buckets are). Blocks are 64 tokens (a
program's float32 accumulator in registers), so a longer step reads a slot once per block that uses it; 8 slots of
Llama 3 8B's up projection are 4.7 MB, which the H100's 50 MB L2 keeps for the blocks after the first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.pallas_kernels.matmul_parts import lane_block, matmul_dot, matmul_precision
from jaxserve.pallas_kernels.softmax import pow2

TPU_BLOCK_T = 256  # tokens a block on TPU: every decode step (<= 256 rows) is one block
GPU_BLOCK_T = 64  # on GPU: a float32 [64, 128] accumulator a program (more rows would spill registers)


def _check(x, a, b, slot):
    (T, d_in), (N, a_in, R), (Nb, Rb, _) = x.shape, a.shape, b.shape
    if a_in != d_in or (Nb, Rb) != (N, R) or slot.shape != (T,):
        raise ValueError(f"lora_delta: x {x.shape}, a {a.shape}, b {b.shape}, slot {slot.shape} do not agree "
                         "(x [T, in], a [N, in, R], b [N, R, out], slot [T])")


def _block_t(T: int, most: int) -> int:
    """Tokens a block: T rounded up to 16 (a bfloat16 sublane tile, Triton's smallest dot) when it fits in one."""
    return min(-(-T // 16) * 16, most)


@functools.partial(jax.jit, static_argnames=("block_t", "num_slots"))
def slot_plan(slot, block_t: int, num_slots: int):
    """Each token block's slots: (plan [blocks * N] int32, counts [blocks] int32). plan[i * N + s] for s < counts[i]
    are the distinct slots (>= 0) of block i's tokens, ascending; the rest repeat the last one (the previous
    blocks' last for a block with none), so the TPU pipeline, which fetches a block only when its index changes,
    reads nothing for them. slot [T] is padded with -1 to whole blocks here."""
    T = slot.shape[0]
    blocks = -(-T // block_t)
    slot = jnp.pad(slot.astype(jnp.int32), (0, blocks * block_t - T), constant_values=-1).reshape(blocks, block_t)
    present = (slot[:, :, None] == jnp.arange(num_slots)).any(axis=1)  # [blocks, N]
    counts = present.sum(axis=1).astype(jnp.int32)
    order = jnp.argsort(~present, axis=1, stable=True).astype(jnp.int32)  # present slots first, ascending
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]  # [blocks]
    source = jax.lax.cummax(jnp.where(counts > 0, jnp.arange(blocks), -1))  # the last block with a slot
    fill = jnp.where(source >= 0, last[jnp.maximum(source, 0)], 0)
    plan = jnp.where(jnp.arange(num_slots) < counts[:, None], order, fill[:, None])
    return plan.reshape(-1), counts


# --- TPU (Mosaic) ---

def _tpu_shrink_kernel(plan_ref, counts_ref, slot_ref, x_ref, a_ref, h_ref, *, num_slots, precision):
    # slot_ref [bt, 1]; x_ref [bt, bk]; a_ref [R, bk] (A transposed); h_ref [bt, R] float32, resident across K
    # blocks and slots
    i, k, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when((k == 0) & (s == 0))
    def _reset():
        h_ref[...] = jnp.zeros(h_ref.shape, jnp.float32)

    @pl.when(s < counts_ref[i])
    def _add():
        mine = slot_ref[...] == plan_ref[i * num_slots + s]  # [bt, 1]
        xa = jax.lax.dot_general(x_ref[...], a_ref[...], (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)  # [bt, R]
        h_ref[...] += jnp.where(mine, xa, 0.0)


def _tpu_expand_kernel(plan_ref, counts_ref, slot_ref, h_ref, b_ref, o_ref, acc_ref, *, num_slots, precision):
    # slot_ref [bt, 1]; h_ref [bt, R] float32; b_ref [R, bn]; o_ref [bt, bn]; acc_ref [bt, bn] float32
    i, s = pl.program_id(0), pl.program_id(2)

    @pl.when(s == 0)
    def _reset():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(s < counts_ref[i])
    def _add():
        mine = slot_ref[...] == plan_ref[i * num_slots + s]
        h = jnp.where(mine, h_ref[...], 0.0).astype(b_ref.dtype)  # bf16 B: the MXU's native product
        acc_ref[...] += matmul_dot(h, b_ref[...], precision)

    @pl.when(s == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_t", "block_k", "block_n", "interpret"))
def lora_delta_tpu(x, a, b, slot, *, block_t=TPU_BLOCK_T, block_k=2048, block_n=2048, interpret=False):
    """`lora_delta_reference` in two Pallas Mosaic kernels (module docstring). block_t: tokens a block (T rounded
    up to 16 if less); block_k, block_n: upper bounds on the K block of `in` and the N block of `out` (multiples of
    128 dividing them, else the whole dimension)."""
    from jax.experimental.pallas import tpu as pltpu
    _check(x, a, b, slot)
    (T, d_in), (N, _, R), d_out = x.shape, a.shape, b.shape[2]
    bt = _block_t(T, block_t)
    blocks = -(-T // bt)
    bk, bn = lane_block(d_in, block_k), lane_block(d_out, block_n)
    plan, counts = slot_plan(slot, bt, N)
    slots = jnp.pad(slot.astype(jnp.int32), (0, blocks * bt - T), constant_values=-1)[:, None]  # [T', 1]
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"))
    # The slot axis runs as many steps as the busiest block has slots (a run-time grid bound): a decode step with
    # one adapter is one step a K or N block, not N; at least one, so that every output block is written.
    steps = jnp.maximum(counts.max(), 1)

    def weights(i, k, s, plan, counts):
        return plan[i * N + s]

    h = pl.pallas_call(
        functools.partial(_tpu_shrink_kernel, num_slots=N, precision=matmul_precision(x.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(blocks, d_in // bk, steps),
            in_specs=[pl.BlockSpec((bt, 1), lambda i, k, s, *_: (i, 0)),
                      pl.BlockSpec((bt, bk), lambda i, k, s, *_: (i, k)),  # the last block may overhang T
                      pl.BlockSpec((None, R, bk), lambda i, k, s, *p: (weights(i, k, s, *p), 0, k))],
            out_specs=pl.BlockSpec((bt, R), lambda i, k, s, *_: (i, 0))),
        out_shape=jax.ShapeDtypeStruct((blocks * bt, R), jnp.float32),
        compiler_params=params, interpret=interpret, name="lora_shrink",
    )(plan, counts, slots, x, jnp.swapaxes(a, 1, 2))  # [T', R]
    return pl.pallas_call(
        functools.partial(_tpu_expand_kernel, num_slots=N, precision=matmul_precision(b.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(blocks, d_out // bn, steps),
            in_specs=[pl.BlockSpec((bt, 1), lambda i, j, s, *_: (i, 0)),
                      pl.BlockSpec((bt, R), lambda i, j, s, *_: (i, 0)),
                      pl.BlockSpec((None, R, bn), lambda i, j, s, *p: (weights(i, j, s, *p), 0, j))],
            out_specs=pl.BlockSpec((bt, bn), lambda i, j, s, *_: (i, j)),
            scratch_shapes=[pltpu.VMEM((bt, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((T, d_out), x.dtype),
        compiler_params=params, interpret=interpret, name="lora_expand",
    )(plan, counts, slots, h, b)


# --- GPU (Triton) ---

def _gpu_shrink_kernel(plan_ref, counts_ref, slot_ref, x_ref, a_ref, h_ref, *, block_k, precision):
    # plan_ref [1, N]; counts_ref [1]; slot_ref [bt]; x_ref [bt, in / split]; a_ref [N, in / split, R];
    # h_ref [bt, R] float32: this split's part
    bt, R = h_ref.shape
    mine_of = slot_ref[...][:, None]  # [bt, 1]

    def k_step(k, h):  # x's columns loaded once, then each slot's rows of A
        cols = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        x = x_ref[:, cols]  # [bt, block_k]

        def slot_step(s, h):
            n = plan_ref[0, s]
            return h + jnp.where(mine_of == n, matmul_dot(x, a_ref[n, cols, :], precision), 0.0)
        return jax.lax.fori_loop(0, counts_ref[0], slot_step, h)

    h_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, k_step, jnp.zeros((bt, R), jnp.float32))


def _gpu_expand_kernel(plan_ref, counts_ref, slot_ref, h_ref, b_ref, o_ref, *, precision):
    # slot_ref [bt]; h_ref [bt, R] float32; b_ref [N, R, bn]; o_ref [bt, bn]
    mine_of = slot_ref[...][:, None]
    h = h_ref[...]

    def slot_step(s, acc):
        n = plan_ref[0, s]
        return acc + matmul_dot(jnp.where(mine_of == n, h, 0.0).astype(b_ref.dtype), b_ref[n], precision)

    acc = jax.lax.fori_loop(0, counts_ref[0], slot_step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_t", "block_k", "block_n", "split_k", "num_warps", "interpret"))
def lora_delta_gpu(x, a, b, slot, *, block_t=GPU_BLOCK_T, block_k=128, block_n=128, split_k=None, num_warps=4,
                   interpret=False):
    """`lora_delta_reference` in two Pallas Triton kernels (module docstring). block_t: tokens a block (a power of
    two >= 16); block_k: `in` columns per loop step of the shrink (a power of two dividing in / split); block_n:
    `out` columns a program of the expand (a power of two dividing out, else out is padded: a copy);
    split_k: shrink programs a token block (default: enough for ~128 programs, each >= block_k columns)."""
    _check(x, a, b, slot)
    (T, d_in), (N, _, R), d_out = x.shape, a.shape, b.shape[2]
    bt = min(pow2(T, 16), block_t)
    blocks = -(-T // bt)
    Tp = blocks * bt
    plan, counts = slot_plan(slot, bt, N)
    plan = plan.reshape(blocks, N)
    slots = jnp.pad(slot.astype(jnp.int32), (0, Tp - T), constant_values=-1)  # [T']
    Rp = max(pow2(R), 16)  # Triton's dot: every dimension >= 16 and a power of two
    if Rp != R:  # zeros: the same product
        a = jnp.pad(a, ((0, 0), (0, 0), (0, Rp - R)))
        b = jnp.pad(b, ((0, 0), (0, Rp - R), (0, 0)))
    x = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    bk = min(block_k, pow2(d_in))
    while d_in % bk:
        bk //= 2
    if bk < 16:
        raise ValueError(f"lora_delta_gpu: in={d_in} has no power-of-two block >= 16 dividing it")
    steps = d_in // bk
    split = split_k or max(d for d in range(1, steps + 1) if steps % d == 0 and blocks * d <= 128)
    compiler = pltriton.CompilerParams(num_warps=num_warps, num_stages=2)
    meta = [pl.BlockSpec((1, N), lambda i, *_: (i, 0)), pl.BlockSpec((1,), lambda i, *_: (i,)),
            pl.BlockSpec((bt,), lambda i, *_: (i,))]
    parts = pl.pallas_call(
        functools.partial(_gpu_shrink_kernel, block_k=bk, precision=matmul_precision(x.dtype)),
        grid=(blocks, split),
        in_specs=meta + [pl.BlockSpec((bt, d_in // split), lambda i, k: (i, k)),
                         pl.BlockSpec((N, d_in // split, Rp), lambda i, k: (0, k, 0))],
        out_specs=pl.BlockSpec((None, bt, Rp), lambda i, k: (k, i, 0)),
        out_shape=jax.ShapeDtypeStruct((split, Tp, Rp), jnp.float32),
        compiler_params=compiler, interpret=interpret, name="lora_shrink",
    )(plan, counts, slots, x, a)
    h = parts.sum(axis=0)  # [T', Rp] float32: the splits' partial sums (tiny)
    bn = min(block_n, pow2(d_out))
    while bn > 16 and d_out % bn:
        bn //= 2
    Np = -(-d_out // bn) * bn
    if Np != d_out:  # slow path (an `out` with no power-of-two block >= 16): B is copied
        b = jnp.pad(b, ((0, 0), (0, 0), (0, Np - d_out)))
    out = pl.pallas_call(
        functools.partial(_gpu_expand_kernel, precision=matmul_precision(b.dtype)),
        grid=(blocks, Np // bn),
        in_specs=meta + [pl.BlockSpec((bt, Rp), lambda i, j: (i, 0)),
                         pl.BlockSpec((N, Rp, bn), lambda i, j: (0, 0, j))],
        out_specs=pl.BlockSpec((bt, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Tp, Np), x.dtype),
        compiler_params=compiler, interpret=interpret, name="lora_expand",
    )(plan, counts, slots, h, b)
    return out[:T, :d_out] if (Tp, Np) != (T, d_out) else out
