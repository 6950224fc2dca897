"""The multi-LoRA kernels (GPU Triton and TPU Mosaic) in Pallas interpret mode on CPU against their jnp oracle, on
fresh seeded random inputs: mixed slots with -1, one slot, none, T not a multiple of the block, ranks 8 / 16 / 64,
float32 and bfloat16; the per-block slot plan and how often it reads each adapter; and the real compilers, deviceless
(v5e, H100), at a Llama-3-8B-sized projection with their HBM use."""
import json
import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.lora import lora_delta_gpu, lora_delta_tpu, slot_plan
from jaxserve.pallas_kernels.reference import lora_delta_reference

from compilers import PYTHON, needs_compilers
from locations import ROOT

# The TPU interpreter fills uninitialised buffers with NaN: an output block or accumulator never written shows.
NAN_MEMORY = pltpu.InterpretParams(uninitialized_memory="nan")
# Small blocks, so the tiny shapes here still cross token, K and N blocks.
KERNELS = {"gpu": lambda *a: lora_delta_gpu(*a, block_t=16, block_k=64, block_n=128, interpret=True),
           "tpu": lambda *a: lora_delta_tpu(*a, block_t=16, block_k=128, block_n=128, interpret=NAN_MEMORY)}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # relative, and absolute in units of the output's largest value


def fresh_rng():
    """New inputs every run; the seed goes into failure messages so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def segments(rng, T, num_slots):
    """A prefill-like step: rows of random lengths, each with one slot (or -1), their tokens contiguous."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(4, T - 1), replace=False))
    return np.concatenate([np.full(n, rng.integers(-1, num_slots)) for n in np.diff([0, *cuts, T])])


SLOTS = {
    "mixed": lambda rng, T, N: rng.integers(-1, N, T),  # decode-like: every token its own row
    "segments": segments,
    "one": lambda rng, T, N: np.full(T, N - 1),
    "none": lambda rng, T, N: np.full(T, -1),
}


# (T, in, out, N, R, slots, dtype): SmolLM2's k/v (576 -> 192: `in` no multiple of 128), its o, 256 -> 384.
CASES = [
    (37, 256, 384, 4, 8, "mixed", jnp.float32),
    (64, 256, 384, 3, 16, "one", jnp.bfloat16),
    (20, 256, 384, 2, 16, "none", jnp.float32),
    (50, 576, 192, 4, 64, "segments", jnp.bfloat16),
    (5, 576, 576, 16, 16, "mixed", jnp.float32),
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("T,d_in,d_out,N,R,slots,dtype", CASES)
def test_matches_the_reference(target, T, d_in, d_out, N, R, slots, dtype):
    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((T, d_in)), dtype)
    a = jnp.asarray(rng.standard_normal((N, d_in, R)) / d_in ** 0.5, dtype)
    b = jnp.asarray(rng.standard_normal((N, R, d_out)), dtype)
    slot = SLOTS[slots](rng, T, N).astype(np.int32)
    got = KERNELS[target](x, a, b, jnp.asarray(slot))
    assert got.shape == (T, d_out) and got.dtype == dtype
    got = np.asarray(got, np.float64)
    want = np.asarray(lora_delta_reference(x, a, b, jnp.asarray(slot)), np.float64)
    assert np.isfinite(got).all(), f"seed {seed}"
    assert (got[slot < 0] == 0).all(), f"rows without an adapter are not exactly 0; seed {seed}"
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-30), err_msg=f"seed {seed}")


@pytest.mark.parametrize("kernel", [lora_delta_gpu, lora_delta_tpu])
def test_default_blocks_match_the_reference(kernel):
    """The block sizes serving runs (TPU 256 tokens a block, GPU 64): 300 tokens, the last block partial."""
    rng, seed = fresh_rng()
    T, d_in, d_out, N, R = 300, 128, 128, 4, 16
    x = jnp.asarray(rng.standard_normal((T, d_in)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((N, d_in, R)) / d_in ** 0.5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((N, R, d_out)), jnp.bfloat16)
    slot = jnp.asarray(segments(rng, T, N), jnp.int32)
    got = kernel(x, a, b, slot, interpret=NAN_MEMORY if kernel is lora_delta_tpu else True)
    want = np.asarray(lora_delta_reference(x, a, b, slot), np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                               err_msg=f"seed {seed}")


def test_bad_shapes_are_refused():
    x, a, b = jnp.zeros((4, 32)), jnp.zeros((2, 32, 16)), jnp.zeros((2, 16, 64))
    for kernel in (lora_delta_gpu, lora_delta_tpu):
        with pytest.raises(ValueError, match="do not agree"):
            kernel(x, a[:, :16], b, jnp.zeros(4, jnp.int32), interpret=True)
        with pytest.raises(ValueError, match="do not agree"):
            kernel(x, a, b, jnp.zeros(3, jnp.int32), interpret=True)


def test_slot_plan_lists_each_blocks_slots_once():
    """Distinct slots per block, ascending; the rest of a block's entries (and a block with none) repeat the last
    slot fetched, so the TPU pipeline reads nothing new for them."""
    slot = jnp.asarray([3, -1, 1, 3, 1, 1, 1, 1, -1, -1, -1, -1, 0, 2, 2, -1], jnp.int32)
    plan, counts = slot_plan(slot, 4, 4)
    assert counts.tolist() == [2, 1, 0, 2]
    assert plan.reshape(4, 4).tolist() == [[1, 3, 3, 3], [1, 1, 1, 1], [1, 1, 1, 1], [0, 2, 2, 2]]
    plan, counts = slot_plan(jnp.full(5, -1, jnp.int32), 4, 3)  # no adapter at all: nothing to do
    assert counts.tolist() == [0, 0] and plan.tolist() == [0] * 6


def adapter_reads(slot, block_t, num_slots):
    """Adapters' A and B read by a step: each block reads each slot it uses once."""
    return int(slot_plan(jnp.asarray(slot, jnp.int32), block_t, num_slots)[1].sum())


@pytest.mark.parametrize("block_t", [256, 64])  # TPU's, GPU's
def test_each_used_adapter_is_read_about_once_a_step(block_t):
    """A decode step (<= 256 rows, 8 adapters mixed at random) reads each used adapter once on TPU (one block), at
    most once per 64-row block on GPU (re-reads then come from its 50 MB L2); a 512-token prefill step (rows of one
    adapter each, contiguous) once per row with an adapter, plus at most once more per block boundary."""
    rng, seed = fresh_rng()
    decode = rng.integers(-1, 8, 64)
    used = len(set(decode.tolist()) - {-1})
    assert adapter_reads(decode, block_t, 8) == used, f"seed {seed}"
    prefill = segments(rng, 512, 8)
    starts = np.flatnonzero(np.diff(prefill, prepend=-2))  # the rows' first tokens
    rows = int((prefill[starts] >= 0).sum())
    assert adapter_reads(prefill, block_t, 8) <= rows + 512 // block_t - 1, f"seed {seed}"


COMPILE = """
import json, sys
from jaxserve.aot import deviceless as aot
rows = []
for target in ("v5e:2x2", "h100"):
    device = aot.target_devices(target)[0]
    for tokens in (64, 512):
        c = aot.compile_lora_kernel(device, tokens, 4096, 14336, 8, 16)
        rows.append(dict(target=target, tokens=tokens, error=c.error, argument_bytes=c.argument_bytes,
                         output_bytes=c.output_bytes, temp_bytes=c.temp_bytes,
                         traffic=[str(t) for t in c.traffic]))
print(json.dumps(rows))
"""


@needs_compilers
def test_kernels_compile_for_tpu_and_gpu():
    """The real Mosaic and Triton compilers, deviceless (v5e, H100), at Llama 3 8B's up projection (4096 -> 14336),
    8 slots of rank 16, bf16, 64- and 512-token steps: no copy of A or B (a relayout of A, whose rank-16 minor
    dimension XLA stores transposed on TPU, would be one), a few KB of temporaries, and HBM use of the arguments and
    output alone."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([PYTHON, "-c", COMPILE], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    weights = 8 * 16 * (4096 + 14336) * 2
    for row in rows:
        print(row)
        assert row["error"] is None, row
        assert row["traffic"] == [], row
        x, out = row["tokens"] * 4096 * 2, row["tokens"] * 14336 * 2
        # the arguments as given (the slots' few bytes padded to a tile on TPU)
        assert 0 <= row["argument_bytes"] - (x + weights + row["tokens"] * 4) < 4096 and row["output_bytes"] == out, row
        assert row["temp_bytes"] < 1 << 20, row
