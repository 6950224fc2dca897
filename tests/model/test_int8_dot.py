"""int8 weights on CPU through XLA's int8 x int8 -> int32 dot (`jaxserve.model.quant.int8_dot_matmul`): its error
against float32, that CPU (and only CPU) lowers an int8 weight's matmul to it, and an engine serving with it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve import SamplingParams
from jaxserve.cpu_kernels import few_row_matmul
from jaxserve.model.quant import Int8Weight, int8_dot_matmul, matmul, quantize_int8

from tiny import make_llm, prompts


def _inputs(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((256, 96)) * rng.uniform(0.01, 2.0, 96), jnp.float32)  # uneven columns
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    x[:, rng.choice(256, 4, replace=False)] *= 40  # outlier channels, as real activations have: they set the scale
    return jnp.asarray(x), quantize_int8(w)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_two_digit_activations_leave_only_the_weights_rounding(rows):
    seed = int(np.random.default_rng().integers(1 << 31))
    x, q = _inputs(seed, rows)
    w = np.asarray(q.values, np.float32) * np.asarray(q.scale)  # the int8 weight as float32: [in, out]
    exact = np.asarray(x) @ w  # what weight-only int8 computes
    amax = np.abs(np.asarray(x)).max(axis=1, keepdims=True)  # [rows, 1]
    column = np.abs(w).sum(axis=0)  # [out]
    got = np.asarray(int8_dot_matmul(x, q))
    # Two digits: each activation within half a step of amax / 127 / 254; float32's own rounding on top.
    bound = 0.5 * amax / (127 * 254) * column + 1e-4 * np.abs(exact) + 1e-5
    assert got.shape == (rows, 96)
    assert (np.abs(got - exact) <= bound).all(), f"seed {seed}: {np.abs(got - exact).max()}"
    # One digit (w8a8) rounds activations 254x more coarsely: the second digit is what keeps int8's quality.
    one = np.abs(np.asarray(int8_dot_matmul(x, q, digits=1)) - exact).max()
    assert one > 20 * np.abs(got - exact).max(), f"seed {seed}"
    assert got.dtype == np.float32
    if rows > few_row_matmul.MAX_ROWS["int8"] or not few_row_matmul.available():
        np.testing.assert_array_equal(np.asarray(matmul(x, q)), got)  # what CPU's matmul runs for an int8 weight
    else:  # a decode's few rows: the FFI kernel, weight-only int8 in float32 (tests/cpu_kernels/test_cpu_kernels.py)
        np.testing.assert_allclose(np.asarray(matmul(x, q)), exact, rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="digits"):
        int8_dot_matmul(x, q, digits=3)


def test_a_zero_row_stays_zero_and_batch_dims_are_kept():
    _, q = _inputs(0, 1)
    x = jnp.zeros((2, 3, 256), jnp.float32).at[1].set(1.0)  # [2, 3, in]: the first rows all zero (amax 0)
    out = np.asarray(int8_dot_matmul(x, q))
    assert out.shape == (2, 3, 96) and not np.isnan(out).any()
    assert (out[0] == 0).all()
    np.testing.assert_allclose(out[1], np.ones((3, 256)) @ (np.asarray(q.values, np.float32) * np.asarray(q.scale)),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_only_cpu_multiplies_int8_weights_with_an_int32_dot(platform):
    """CPU: XLA:CPU's weight-only int8 (a convert into a float dot) ran 3-9x slower than float32, its integer dot
    faster (scripts/bench_formats.py); TPU and GPU keep weight-only int8, as before. Up to
    few_row_matmul.MAX_ROWS rows CPU runs the FFI kernel instead (weight-only, streamed); with kernels=False (a
    tensor-parallel split) a one-row product has two digit rows, so it stays a GEMM rather than XLA:CPU's slow
    one-row integer loop."""
    sds = jax.ShapeDtypeStruct
    w = jax.eval_shape(lambda: quantize_int8(jnp.zeros((576, 192), jnp.float32)))
    assert isinstance(w, Int8Weight)
    few = few_row_matmul.MAX_ROWS["int8"]
    for rows, kernels in ((1, False), (few + 1, True), (64, True)):
        mm = jax.jit(lambda x, w: matmul(x, w, kernels=kernels))
        text = export.export(mm, platforms=[platform])(sds((rows, 576), jnp.float32), w).mlir_module()
        int_dot = f"(tensor<{2 * rows}x576xi8>, tensor<576x192xi8>) -> tensor<{2 * rows}x192xi32>"
        assert (int_dot in text) == (platform == "cpu"), (platform, rows)
    if platform == "cpu" and few_row_matmul.available():
        text = jax.jit(matmul).lower(sds((few, 576), jnp.float32), w).as_text()
        assert few_row_matmul.INT8_TARGET in text and "xi32>" not in text


def test_engine_greedy_output_with_int8_weights_is_weight_only_int8s(tiny_dir):
    """The engine's int8 weights through the int8 dot on CPU serve what weight-only int8 does (the same weights,
    dequantized to float32 kernels): each greedy token's log-probability within 0.01 until their paths part, which
    they may only at a near-tie. (Against float32 itself, the weights' rounding moves this random model's
    log-probabilities by up to ~0.2: int8's cost on a real model is its perplexity, tests/quantize/test_quant.py.)"""
    seed = int(np.random.default_rng().integers(1 << 31))
    ps = prompts(np.random.default_rng(seed), [40, 7, 25])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = make_llm(tiny_dir, quantization="int8")
    assert isinstance(llm.runner.params["params"]["layers_0"]["o_proj"]["kernel"], Int8Weight)
    int8 = [o.outputs[0] for o in llm.generate(ps, sp, use_tqdm=False)]
    ref = make_llm(tiny_dir)
    ref.runner.params = jax.tree_util.tree_map(
        lambda n: n.values.astype(jnp.float32) * n.scale if isinstance(n, Int8Weight) else n, llm.runner.params,
        is_leaf=lambda n: isinstance(n, Int8Weight))
    weight_only = [o.outputs[0] for o in ref.generate(ps, sp, use_tqdm=False)]
    for f, q in zip(weight_only, int8):
        same = next((i for i, (a, b) in enumerate(zip(f.token_ids, q.token_ids)) if a != b), len(f.token_ids))
        for i in range(same):
            token = f.token_ids[i]
            assert abs(f.logprobs[i][token].logprob - q.logprobs[i][token].logprob) < 0.01, f"seed {seed}"
        if same < len(f.token_ids):
            top = sorted(lp.logprob for lp in f.logprobs[same].values())[-2:]
            assert top[1] - top[0] < 0.01, (f"seed {seed}", same, top)
