"""Fused projections (`jaxserve.model.fused`): a CPU runner on one device serves each layer's q/k/v as one kernel
and gate/up as one, and gets the unfused model's logits from fewer dots."""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cpu_kernels import few_row_matmul
from jaxserve.model.fused import fuse_kernels, with_fused_projections
from jaxserve.model.quant import Int4Weight, Int8Weight, quantize_int4, quantize_params
from jaxserve.quantize.perplexity import next_token_logits
from jaxserve.runner import model_runner
from jaxserve.runner.batch_builder import Row
from jaxserve.weights import load_model

from programs import step_program
from tiny import make_llm


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def family(request, tmp_path_factory):
    """(config, params) of a tiny random model of each family: biases (qwen2), QK-norm and a head_dim other than
    hidden / heads (qwen3), GeGLU and sandwich norms (gemma3)."""
    from hf_models import save_tiny_model
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, path)
    loaded = load_model(str(path), jnp.float32)
    return loaded.config, loaded.params


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_fused_params_give_the_unfused_logits(family, quantization):
    config, params = family
    params = quantize_params(params, quantization) if quantization else params
    fused = with_fused_projections(params)
    layer = fused["params"]["layers_0"]
    assert {"qkv_proj", "gate_up_proj"} <= set(layer) and not {"q_proj", "k_proj", "v_proj", "gate_proj",
                                                                   "up_proj"} & set(layer)
    assert ("bias" in layer["qkv_proj"]) == config.attention_bias
    seed = int(np.random.default_rng().integers(1 << 31))
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, 40).tolist()
    want = next_token_logits(config, params, ids, chunk=16)
    got = next_token_logits(config, fused, ids, chunk=16)
    # The same products, summed in another dot: float32 rounding apart (int8's integer dot is exact either way).
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), err_msg=f"seed {seed}")


def test_kernels_that_read_the_input_differently_stay_apart():
    rng = np.random.default_rng(0)
    w = [jnp.asarray(rng.standard_normal((64, n), np.float32)) for n in (64, 32)]
    assert fuse_kernels(w).shape == (64, 96)
    assert fuse_kernels([w[0], w[1].astype(jnp.bfloat16)]) is None  # two dtypes
    assert fuse_kernels([quantize_int4(w[0]), w[1]]) is None  # two kinds
    assert fuse_kernels([quantize_int4(w[0], 32), quantize_int4(w[1], 16)]) is None  # two group sizes
    scaled = [Int4Weight(**{**vars(quantize_int4(x)), "input_scale": jnp.full(64, s, jnp.float32)})
              for x, s in zip(w, (1.0, 2.0))]
    assert fuse_kernels(scaled) is None  # AWQ scales the shared input two ways
    same = [Int4Weight(**{**vars(k), "input_scale": scaled[0].input_scale}) for k in scaled]
    assert isinstance(fuse_kernels(same), Int4Weight) and fuse_kernels(same).packed.shape[-1] == 96


def dots(hlo: str) -> int:
    """The products of a compiled program: XLA's dots, wherever it put them (the top level, or inside a fusion),
    and the few-row CPU kernel's calls (jaxserve.cpu_kernels.few_row_matmul)."""
    kernel = "|".join((few_row_matmul.FLOAT_TARGET, few_row_matmul.INT8_TARGET))
    return len(re.findall(r" dot\(", hlo)) + len(re.findall(rf'custom_call_target="(?:{kernel})"', hlo))


def test_the_cpu_runner_serves_fused_projections_with_fewer_dots(tiny_dir, monkeypatch):
    """Per layer, q/k/v's three dots become one and gate/up's two one: two layers, six dots fewer a step. A LoRA
    runner serves them fused too (its adapters' terms are added to the fused outputs)."""
    rows = [Row([5], 8, [1, 2, 3], slot=0, chained=True)]
    for quantization, kind in ((None, jnp.ndarray), ("int8", Int8Weight)):
        llm = make_llm(tiny_dir, quantization=quantization)
        assert isinstance(llm.runner.params["params"]["layers_1"]["qkv_proj"]["kernel"], kind)
        fused = dots(step_program(llm, rows))
        with monkeypatch.context() as m:
            m.setattr(model_runner, "with_fused_projections", lambda params: params)
            apart = make_llm(tiny_dir, quantization=quantization)
        assert "q_proj" in apart.runner.params["params"]["layers_1"]
        assert fused == dots(step_program(apart, rows)) - 2 * 3, quantization
    lora = make_llm(tiny_dir, enable_lora=True, max_loras=1, max_lora_rank=4)
    assert "qkv_proj" in lora.runner.params["params"]["layers_0"]
