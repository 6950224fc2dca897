"""int8 weight-only quantization: the quantized pytree, the matmul, and its cost in quality on the default model."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.quant import Int4Weight, Int8Weight, matmul, quantize_int4, quantize_int8, quantize_params
from jaxserve.perplexity import next_token_logits, perplexity
from jaxserve.weights import load_model
from jaxserve.weights.params import param_bytes

TEXT = (Path(__file__).parent / "data" / "gettysburg.txt").read_text()  # public domain (Lincoln, 1863)


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


def test_int4_packs_two_values_per_byte_within_half_a_step():
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((200, 48)), jnp.float32)  # 200 rows: not a whole number of 128-groups
    q = quantize_int4(w, group_size=128)
    assert q.packed.dtype == jnp.uint8 and q.packed.shape == (128, 48) and q.scale.shape == (2, 48)
    assert q.shape == (200, 48)
    groups = np.repeat(np.asarray(q.scale), 128, axis=0)[:200]  # each row's group scale
    assert (np.abs(np.asarray(q.dequantize(jnp.float32)) - np.asarray(w)) <= groups / 2 + 1e-6).all()
    x = jnp.asarray(rng.standard_normal((3, 200)), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul(x, q)), np.asarray(x @ q.dequantize(jnp.float32)), rtol=1e-5,
                               atol=1e-5)
    assert isinstance(quantize_params({"a": {"kernel": w}}, "int4")["a"]["kernel"], Int4Weight)


def test_quantize_params_skips_norms_embeddings_and_the_head():
    params = {"params": {"embed_tokens": jnp.ones((10, 4)), "lm_head": {"kernel": jnp.ones((4, 10))},
                         "layers_0": {"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)},
                                      "input_layernorm": {"weight": jnp.ones(4)}}}}
    out = quantize_params(params, "int8")["params"]
    assert isinstance(out["layers_0"]["q_proj"]["kernel"], Int8Weight)
    assert not isinstance(out["lm_head"]["kernel"], Int8Weight)
    assert out["layers_0"]["q_proj"]["bias"] is params["params"]["layers_0"]["q_proj"]["bias"]
    assert isinstance(quantize_params(params, "int8", quantize_lm_head=True)["params"]["lm_head"]["kernel"],
                      Int8Weight)
    with pytest.raises(ValueError, match="quantization"):
        quantize_params(params, "int3")


def text_perplexity(loaded, params, text):
    ids = loaded.tokenizer.encode(text)
    return perplexity(next_token_logits(loaded.config, params, ids), ids), len(ids)


def test_int8_costs_under_one_percent_of_perplexity(default_gguf_path):
    loaded = load_model(str(default_gguf_path), jnp.float32)
    fp32, n = text_perplexity(loaded, loaded.params, TEXT)
    int8, _ = text_perplexity(loaded, quantize_params(loaded.params, "int8"), TEXT)
    assert n > 300 and fp32 < 30  # a real text the model reads well
    assert abs(int8 - fp32) / fp32 < 0.01, (fp32, int8)


def test_engine_generates_with_int8_weights(default_gguf_path):
    llm = LLM(str(default_gguf_path), max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
              quantization="int8", warmup=False)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    int4 = LLM(str(default_gguf_path), max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
               quantization="int4", warmup=False)
    out = int4.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert isinstance(int4.runner.params["params"]["layers_0"]["q_proj"]["kernel"], Int4Weight)
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(default_gguf_path), quantization="fp4", warmup=False)


def test_quality_script_runs(default_gguf_path, tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "quality.json"
    r = subprocess.run([sys.executable, "scripts/eval_quality.py", "--out", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["format"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"float32", "bfloat16", "int8", "int4"} and rows["float32"]["top1_agreement"] == 1.0
    assert rows["int8"]["weight_bytes"] < 0.6 * rows["float32"]["weight_bytes"]
