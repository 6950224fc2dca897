"""The weight-only group-wise int4 matmul kernels (GPU and TPU) in Pallas interpret mode on CPU, on fresh random
inputs, against their jnp reference and against a float64 numpy matmul of weights dequantized here (the int4 layout
checked independently of the module); SmolLM2's projection shapes, decode-sized M, float32 and bfloat16; and their
Triton / Mosaic lowering at a serving shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels import int4_matmul, int4_matmul_tpu
from jaxserve.pallas_kernels.quantized_matmul import int4_matmul_reference

# The TPU interpreter fills uninitialised buffers with NaN, so an output element (or accumulator) never written shows.
NAN_MEMORY = pltpu.InterpretParams(uninitialized_memory="nan")
INT4 = {"gpu": lambda *a, **kw: int4_matmul(*a, interpret=True, **kw),
        "tpu": lambda *a, **kw: int4_matmul_tpu(*a, interpret=NAN_MEMORY, **kw)}

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # relative, and absolute in units of the output's largest value


def fresh_rng():
    """New inputs every run; the seed goes into failure messages so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def check(got, want, dtype, seed):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), f"seed {seed}"
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"seed {seed}")


def int4_weights(rng, K, N, group_size):
    """Random packed int4 weights in the fixed layout, and the same weights dequantized here in float64 [K_pad, N]."""
    K_pad = -(-K // group_size) * group_size
    q = rng.integers(0, 16, (K_pad, N))
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)  # row 2i: low nibble, 2i + 1: high nibble of packed[i]
    scale = rng.uniform(0.5, 2.0, (K_pad // group_size, N)).astype(np.float16) / 15
    offset = rng.uniform(-1.0, 0.0, (K_pad // group_size, N)).astype(np.float16)
    group = np.arange(K_pad) // group_size
    dense = q * scale.astype(np.float64)[group] + offset.astype(np.float64)[group]
    return packed, scale, offset, dense


# (M, K, N, group_size, dtype, {target: kernel options}). SmolLM2-135M: q/o, gate/up (576 -> 1536), down
# (1536 -> 576), k/v (576 -> 192).
INT4_CASES = [
    (1, 576, 1536, 32, jnp.float32, {"tpu": dict(block_n=512)}),
    (5, 576, 1536, 128, jnp.bfloat16, {}),  # 4.5 groups: x zero-padded to 640 columns
    (32, 1536, 576, 64, jnp.bfloat16, {"gpu": dict(max_block_m=16, block_n=64, block_k=128, split_k=3),
                                       "tpu": dict(max_block_m=16)}),
    (1, 1536, 576, 32, jnp.float32, {"gpu": dict(split_k=1), "tpu": dict(block_k=512)}),  # TPU: 3 K steps
    (5, 576, 192, 64, jnp.float32, {"gpu": dict(block_k=64)}),  # GPU: one group a step
    (32, 576, 192, 32, jnp.bfloat16, {}),
    (3, 100, 24, 32, jnp.float32, {}),  # N not a multiple of 16: GPU pads (the slow path)
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("M,K,N,group_size,dtype,options", INT4_CASES)
def test_int4_matmul(target, M, K, N, group_size, dtype, options):
    rng, seed = fresh_rng()
    packed, scale, offset, dense = int4_weights(rng, K, N, group_size)
    x = rng.standard_normal((M, K))
    x = jnp.asarray(np.pad(x, ((0, 0), (0, dense.shape[0] - K))), dtype)  # the caller pads x to K_pad, with zeros
    args = (x, jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(offset))
    got = INT4[target](*args, group_size=group_size, **options.get(target, {}))
    assert got.shape == (M, N) and got.dtype == dtype
    check(got, int4_matmul_reference(*args, group_size=group_size), dtype, seed)
    check(got, np.asarray(x, np.float64) @ dense, dtype, seed)


def test_bad_shapes_are_refused():
    x = jnp.zeros((2, 64), jnp.float32)
    for int4 in (int4_matmul, int4_matmul_tpu):
        with pytest.raises(ValueError, match="do not agree"):  # x not padded to whole groups
            int4(x[:, :48], jnp.zeros((24, 16), jnp.uint8), jnp.ones((2, 16), jnp.float16),
                 jnp.zeros((2, 16), jnp.float16), group_size=32, interpret=True)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_kernels_lower_for_their_hardware(monkeypatch, platform, group_size):
    """Lowering at a serving shape (M=8, K=N=4096, bfloat16) runs here without the hardware: Pallas' Triton and
    Mosaic TPU lowerings check block shapes and ops (the device compilers' own checks still wait for hardware)."""
    from jax import export
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")  # Mosaic asks which chip it targets
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    sds, K, N = jax.ShapeDtypeStruct, 4096, 4096
    x = sds((8, K), jnp.bfloat16)
    int4 = int4_matmul if platform == "cuda" else int4_matmul_tpu
    fn = lambda *a: int4(*a, group_size=group_size)  # noqa: E731
    args = (x, sds((K // 2, N), jnp.uint8), *[sds((K // group_size, N), jnp.float16)] * 2)
    # Triton kernels carry no serialization guarantee; lowering them is what is checked.
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    lowered = export.export(jax.jit(fn), platforms=[platform], disabled_checks=unchecked)(*args)
    assert "custom_call" in lowered.mlir_module()
