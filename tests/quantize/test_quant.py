"""Weight quantization (int8, int4, AWQ) and the int8 KV cache: the formats, and their cost in quality on the
default model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cache import Int8Pages, bytes_per_page, init_kv_cache
from jaxserve.cache.kv_cache import read_pages, write_pages
from jaxserve.model.quant import (
    KERNEL_MAX_ROWS,
    Int4Weight,
    Int8Rows,
    Int8Weight,
    embed,
    matmul,
    quantize_int4,
    quantize_int8,
    quantize_params,
    quantize_rows_int8,
)
from jaxserve.quantize.apply import quantize_model
from jaxserve.quantize.awq import CALIBRATION_TEXT, quantize_awq, search_input_scale
from jaxserve.quantize.perplexity import next_token_logits, perplexity
from jaxserve.weights import load_model
from jaxserve.weights.params import param_bytes

from locations import DATA
from tiny import make_llm, prompts

INT8_PAGE_BYTES = 2 * 2 * 4 * 2 * (16 + 4)  # K and V, 2 layers, 4 tokens, 2 KV heads, 16 int8 + a float32 scale

# Chapter I of Alice's Adventures in Wonderland (Lewis Carroll, 1865; public domain), ~2.7k tokens. The tests read
# its first 1024 (scripts/eval_quality.py all of it); AWQ calibrates on a different chapter.
TEXT = (DATA / "alice_ch1.txt").read_text()
TEST_TOKENS = 1024


def test_int8_matmul_is_close_and_the_bytes_are_a_quarter():
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((256, 96)) * rng.uniform(0.01, 2.0, 96), jnp.float32)  # uneven columns
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    q = quantize_int8(w)
    assert q.values.dtype == jnp.int8 and q.scale.shape == (96,)
    err = np.abs(np.asarray(matmul(x, q)) - np.asarray(x @ w))
    # Per-column rounding error: at most half a step (scale / 2) per weight, summed over 256 inputs.
    assert (err <= 0.5 * np.asarray(q.scale) * np.abs(np.asarray(x)).sum(axis=1, keepdims=True) + 1e-5).all()
    assert param_bytes(q) < 0.26 * w.nbytes + 96 * 4 + 1


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_packs_two_values_per_byte_within_half_a_step(group_size):
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((200, 48)) + rng.standard_normal(48), jnp.float32)  # not centred on 0
    q = quantize_int4(w, group_size=group_size)  # 200 rows: not a whole number of groups
    groups = -(-200 // group_size)
    assert q.packed.dtype == jnp.uint8 and q.packed.shape == (groups * group_size // 2, 48)
    assert q.scale.shape == q.offset.shape == (groups, 48) and q.scale.dtype == jnp.float16
    assert q.group_size == group_size
    step = np.repeat(np.asarray(q.scale, np.float32), group_size, axis=0)[:200]  # each row's group step
    err = np.abs(np.asarray(q.dequantize(jnp.float32))[:200] - np.asarray(w))
    assert (err <= 0.55 * step).all()  # half a step, and a little for float16 steps at the top of the range
    x = jnp.asarray(rng.standard_normal((3, 200)), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul(x, q)), np.asarray(x @ q.dequantize(jnp.float32)[:200]),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_matmul_reads_int4_through_the_pallas_kernel_on_tpu_and_gpu(monkeypatch, platform):
    """`matmul` as lowered for each platform: on TPU and GPU an int4 weight goes to the Pallas kernel (XLA would
    write a float copy of the weight first), unless it is split over a mesh (kernels=False); CPU keeps jnp. On GPU
    a one-row product of a float or int8 weight has a second row (XLA:GPU would write the weight-sized product of a
    multiply + reduce); on CPU a bf16 one has 8 (XLA:CPU's one-row bf16 dot is a slow loop:
    tests/model/test_bf16_cpu.py) where the few-row CPU kernel is not used (kernels=False;
    tests/cpu_kernels/test_cpu_kernels.py)."""
    from jax import export
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")  # Mosaic asks which chip it targets
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    sds = jax.ShapeDtypeStruct
    w = jax.eval_shape(lambda: quantize_int4(jnp.zeros((576, 192), jnp.float32)))
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

    def lowered(fn, *args):
        return export.export(jax.jit(fn), platforms=[platform], disabled_checks=unchecked)(*args).mlir_module()
    x = sds((3, 576), jnp.bfloat16)
    assert ("custom_call" in lowered(matmul, x, w)) == (platform != "cpu")
    assert "custom_call" not in lowered(lambda x, w: matmul(x, w, kernels=False), x, w)
    assert "custom_call" not in lowered(matmul, sds((KERNEL_MAX_ROWS + 1, 576), jnp.bfloat16), w)  # prefill: XLA
    one_row = lowered(lambda x, w: matmul(x, w, kernels=False), sds((1, 576), jnp.bfloat16),
                      sds((576, 192), jnp.bfloat16))
    assert ("tensor<2x576xbf16>" in one_row) == (platform == "cuda")
    assert ("tensor<8x576xbf16>" in one_row) == (platform == "cpu")


def test_int4_keeps_a_q4_1_grid_exactly():
    """Weights already on llama.cpp's Q4_1 grid (groups of 32, float16 step and minimum) come back unchanged:
    the default model ships so, which is why int4 costs it nothing."""
    rng = np.random.default_rng()
    step = rng.uniform(1e-3, 5e-2, (6, 1, 40)).astype(np.float16).astype(np.float32)
    low = rng.uniform(-0.5, 0.0, (6, 1, 40)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (6, 32, 40))
    q[:, 0], q[:, 1] = 0, 15  # each group spans the grid, as a Q4_1 block of real weights does
    w = (q * step + low).reshape(192, 40)
    got = np.asarray(quantize_int4(jnp.asarray(w), group_size=32).dequantize(jnp.float32))
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-7)


def test_awq_scales_protect_salient_input_channels():
    rng = np.random.default_rng()
    n_in, n_out = 256, 64
    x = rng.standard_normal((512, n_in)).astype(np.float32)
    x[:, rng.choice(n_in, 8, replace=False)] *= 30  # a few channels carry large activations, as in real models
    w = jnp.asarray(rng.standard_normal((n_in, n_out)) * 0.02, jnp.float32)
    scale, errors = search_input_scale(jnp.asarray(x), w, 128)
    errors = np.asarray(errors)
    assert errors.argmin() > 0 and errors.min() < 0.7 * errors[0]  # errors[0]: alpha 0, plain rounding
    ref = x @ np.asarray(w)
    plain = np.mean((np.asarray(matmul(jnp.asarray(x), quantize_int4(w, 128))) - ref) ** 2)
    awq = np.mean((np.asarray(matmul(jnp.asarray(x), quantize_int4(w, 128, scale))) - ref) ** 2)
    assert awq < 0.7 * plain


def test_quantize_params_skips_norms_and_quantizes_embeddings_only_when_asked():
    params = {"params": {"embed_tokens": jnp.ones((10, 4)), "lm_head": {"kernel": jnp.ones((4, 10))},
                         "layers_0": {"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)},
                                      "input_layernorm": {"weight": jnp.ones(4)}}}}
    out = quantize_params(params, "int8")["params"]
    assert isinstance(out["layers_0"]["q_proj"]["kernel"], Int8Weight)
    assert not isinstance(out["lm_head"]["kernel"], Int8Weight) and not isinstance(out["embed_tokens"], Int8Rows)
    assert out["layers_0"]["q_proj"]["bias"] is params["params"]["layers_0"]["q_proj"]["bias"]
    both = quantize_params(params, "int4", quantize_embeddings=True)["params"]
    assert isinstance(both["lm_head"]["kernel"], Int4Weight) and isinstance(both["embed_tokens"], Int8Rows)
    with pytest.raises(ValueError, match="quantization"):
        quantize_params(params, "int3")
    with pytest.raises(ValueError, match="calibration"):
        quantize_params(params, "awq")


@pytest.mark.parametrize("method", ["int8", "int4", "awq"])
def test_quantized_leaves_take_their_float_kernels_axes(tiny_dir, method):
    """Each array of a quantized weight is split as its float kernel is (jaxserve.parallel.mesh.param_shardings):
    its logical axes come from the kernel's [in, out] ones, or the table's [vocab, hidden]."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.model.decoder import param_axes
    from jaxserve.model.families import LINEARS
    loaded = load_model(tiny_dir, jnp.float32)
    floats = param_axes(loaded.config, loaded.params)["params"]
    scales = {("params", name, linear): jnp.ones(kernel["kernel"].shape[0])
              for name, layer in loaded.params["params"].items() if name.startswith("layers_")
              for linear, kernel in layer.items() if "kernel" in kernel}
    scales[("params", "lm_head")] = jnp.ones(loaded.config.hidden_size)
    params = quantize_params(loaded.params, method, quantize_embeddings=True, group_size=16,
                             input_scales=scales if method == "awq" else None)
    axes = param_axes(loaded.config, params)["params"]
    assert floats["layers_0"]["down_proj"]["kernel"] == P("mlp", "embed")
    pairs = [(floats["lm_head"], axes["lm_head"])] + [(floats[layer][linear], axes[layer][linear])
                                                       for layer in floats if layer.startswith("layers_")
                                                       for linear in LINEARS]
    for float_layer, layer in pairs:
        kernel = float_layer["kernel"]  # P(in, out)
        if method == "int8":
            assert layer["kernel"] == Int8Weight(values=kernel, scale=P(kernel[1]))
        else:
            assert layer["kernel"] == Int4Weight(packed=kernel, scale=kernel, offset=kernel,
                                                 input_scale=P(kernel[0]) if method == "awq" else None)
    assert axes["embed_tokens"] == Int8Rows(values=P("vocab", "embed"), scale=P("vocab"))
    # Norms and biases are not quantized: their axes are the float model's.
    assert axes["layers_0"]["input_layernorm"] == floats["layers_0"]["input_layernorm"] == {"weight": P("embed")}


def test_int8_embedding_rows():
    rng = np.random.default_rng()
    table = jnp.asarray(rng.standard_normal((50, 16)) * rng.uniform(0.1, 3, (50, 1)), jnp.float32)
    q = quantize_rows_int8(table)
    ids = jnp.asarray(rng.integers(0, 50, (3, 5)))
    got, want = np.asarray(embed(q, ids, jnp.float32)), np.asarray(table[ids])
    assert got.shape == (3, 5, 16)
    assert (np.abs(got - want) <= 0.5 * np.asarray(q.scale)[np.asarray(ids)][..., None] + 1e-6).all()


def test_int8_kv_pages_round_trip_and_bytes():
    rng = np.random.default_rng()
    pages = Int8Pages(jnp.zeros((4, 2, 8, 16), jnp.int8), jnp.zeros((4, 2, 8), jnp.float32))
    x = jnp.asarray(rng.standard_normal((5, 2, 16)) * rng.uniform(0.1, 10, (5, 2, 1)), jnp.float32)
    slots = jnp.asarray([8, 9, 10, 30, 31])
    pages = write_pages(pages, x, slots)
    flat = read_pages(pages, jnp.arange(4), jnp.float32).reshape(-1, 2, 16)
    scale = np.swapaxes(np.asarray(pages.scale), 1, 2).reshape(-1, 2)[np.asarray(slots)]
    assert (np.abs(np.asarray(flat[slots]) - np.asarray(x)) <= 0.5 * scale[..., None] + 1e-6).all()
    assert not np.asarray(flat[:8]).any()  # nothing written outside the slots

    class Config:
        num_layers, num_kv_heads, head_dim = 30, 3, 64
    ratio = bytes_per_page(Config, 16, jnp.float32, "int8") / bytes_per_page(Config, 16, jnp.bfloat16)
    assert ratio == (64 + 4) / 128  # 1.88x the sequences of bfloat16 pages, 3.8x float32's
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        init_kv_cache(Config, 4, 16, jnp.float32, "fp8")


def test_engine_with_int8_kv_cache(tiny_dir):
    """int8 pages through chunked prefill, batched decode and preemption: each token's log-probability stays near
    float pages' until their greedy paths part (only at a near-tie), and no page is left held. (Not token-exact across
    batchings, as float pages are: a recomputed key that differs in its last bit can round to another int8 step, and
    this random model's near-ties flip. The real model's cost is its perplexity, below.)"""
    rng = np.random.default_rng()
    ps = prompts(rng, [40, 7, 25])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    # 20 pages of 4 tokens: three sequences of up to 64 tokens (16 pages each) cannot all fit: some are preempted.
    llm = make_llm(tiny_dir, kv_cache_dtype="int8", kv_cache_memory_bytes=21 * INT8_PAGE_BYTES,
                   max_model_len=80)
    assert isinstance(llm.runner.kv_cache[0][0], Int8Pages) and llm.runner.kv_cache[0][0].shape[0] == 21
    together = [o.outputs[0] for o in llm.generate(ps, sp, use_tqdm=False)]
    assert llm.stats().num_preemptions > 0
    llm.core.assert_idle_and_clean()
    floats = [o.outputs[0] for o in make_llm(tiny_dir).generate(ps, sp, use_tqdm=False)]
    for f, q in zip(floats, together):
        same = next((i for i, (a, b) in enumerate(zip(f.token_ids, q.token_ids)) if a != b), len(f.token_ids))
        for i in range(same):
            token = f.token_ids[i]
            assert abs(f.logprobs[i][token].logprob - q.logprobs[i][token].logprob) < 0.5
        if same < len(f.token_ids):  # they part only where float pages' top two nearly tie
            top = sorted(lp.logprob for lp in f.logprobs[same].values())[-2:]
            assert top[1] - top[0] < 0.5, (same, top)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_llm(tiny_dir, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def default_float32():
    """The default model loaded in float32 (a GGUF's dequantizing is slow: loaded once here)."""
    return load_model(None, jnp.float32)


@pytest.fixture(scope="module")
def model(default_float32):
    loaded = default_float32
    ids = loaded.tokenizer.encode(TEXT)[:TEST_TOKENS]
    fp32 = perplexity(next_token_logits(loaded.config, loaded.params, ids), ids)
    assert fp32 < 40  # a real text the model reads well
    return loaded, ids, fp32


def text_perplexity(model, params, **kw):
    loaded, ids, _ = model
    return perplexity(next_token_logits(loaded.config, params, ids, **kw), ids)


def test_int8_costs_under_one_percent_of_perplexity(model):
    loaded, _, fp32 = model
    int8 = text_perplexity(model, quantize_params(loaded.params, "int8"))
    assert abs(int8 - fp32) / fp32 < 0.01, (fp32, int8)


def test_int4_costs_under_ten_percent_and_awq_beats_plain_int4(model):
    loaded, _, fp32 = model
    int4 = text_perplexity(model, quantize_params(loaded.params, "int4"))  # groups of 32
    assert abs(int4 - fp32) / fp32 < 0.10, (fp32, int4)
    plain = text_perplexity(model, quantize_params(loaded.params, "int4", group_size=128))
    calibration = loaded.tokenizer.encode(CALIBRATION_TEXT.read_text())[:512]
    awq = text_perplexity(model, quantize_awq(loaded.config, loaded.params, calibration, 128))
    assert fp32 < awq < 0.9 * plain, (fp32, awq, plain)


def test_int8_kv_cache_costs_under_one_percent_of_perplexity(model):
    loaded, _, fp32 = model
    # A page at a time, so nearly every key is read back from the int8 pages (one prefill would see none).
    int8_kv = text_perplexity(model, loaded.params, kv_cache_dtype="int8", chunk=16)
    assert int8_kv != fp32 and abs(int8_kv - fp32) / fp32 < 0.01, (fp32, int8_kv)


def test_bfloat16_costs_under_one_percent_of_perplexity(model):
    """Every weight, activation and KV page bf16 (XLA:CPU's bf16 dots accumulate in float32), a page at a time
    through the cache: measured -0.05% (float32 25.36; int8 weights +0.33%)."""
    loaded, _, fp32 = model
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), loaded.params)
    bf16 = text_perplexity(model, params, dtype=jnp.bfloat16, chunk=16)
    assert bf16 != fp32 and abs(bf16 - fp32) / fp32 < 0.01, (fp32, bf16)


def test_engine_generates_with_quantized_weights(default_gguf_path):
    """int4 quantized as the engine loads (int8 weights are served by the convert test below, from a checkpoint).
    One token a step, the prompt's included: one step shape of the 30-layer model to compile."""
    llm = LLM(str(default_gguf_path), dtype="float32", max_model_len=256, max_num_seqs=1, max_num_batched_tokens=1,
              quantization="int4", warmup=False)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert isinstance(llm.runner.params["params"]["layers_0"]["o_proj"]["kernel"], Int4Weight)
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(default_gguf_path), quantization="fp4", warmup=False)
    with pytest.raises(ValueError, match="group size"):
        LLM(str(default_gguf_path), quantization="int8", quantization_group_size=64, warmup=False)


@pytest.mark.parametrize("method", ["int8", "awq"])
def test_convert_writes_a_quantized_checkpoint_that_loads_directly(default_gguf_path, default_float32, tmp_path,
                                                                   method):
    from jaxserve.cli import main
    dst = tmp_path / "ckpt"
    args = ["convert", str(default_gguf_path), str(dst), "--quantization", method, "--quantize-embeddings"]
    if method == "awq":
        cal = tmp_path / "cal.txt"
        cal.write_text(CALIBRATION_TEXT.read_text()[:400])  # ~90 tokens: the checkpoint, not the scales, is tested
        args += ["--calibration-file", str(cal), "--quantization-group-size", "64"]
    assert main(args) == 0
    loaded = load_model(str(dst), jnp.float32)
    assert loaded.quantization["method"] == method and isinstance(loaded.params["params"]["embed_tokens"], Int8Rows)
    leaves = jax.tree.leaves(loaded.params["params"]["layers_3"]["down_proj"], is_leaf=lambda x: x is None)
    stored = jnp.dtype(jnp.int8 if method == "int8" else jnp.uint8)
    assert stored in {leaf.dtype for leaf in leaves if leaf is not None}
    assert param_bytes(loaded.params) < 0.4 * param_bytes(default_float32.params)
    # Served as written: quantized again only if asked the same way, refused otherwise.
    assert quantize_model(loaded, method, quantize_embeddings=True,
                          group_size=64 if method == "awq" else None).quantization == loaded.quantization
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(loaded, "int4")
    llm = LLM(str(dst), dtype="float32", max_model_len=128, max_num_seqs=1, max_num_batched_tokens=32, warmup=False)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_quality_script_runs(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "quality.json"
    r = subprocess.run([sys.executable, "scripts/eval_quality.py", "--tokens", "256", "--formats",
                        "float32,int8,int8-kv", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["format"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"float32", "int8", "int8-kv"} and rows["float32"]["top1_agreement"] == 1.0
    assert rows["int8"]["weight_bytes"] < 0.6 * rows["float32"]["weight_bytes"]


def test_awq_refuses_what_it_cannot_calibrate_on(tiny_dir, default_float32):
    with pytest.raises(ValueError, match="tokenizer"):
        quantize_model(load_model(tiny_dir, jnp.float32), "awq")  # no tokenizer to read the text with
    with pytest.raises(ValueError, match="at least 64"):
        quantize_model(default_float32, "awq", calibration_text="Too short.")
