"""RoPE scaling against HF transformers' ROPE_INIT_FUNCTIONS (inverse frequencies and attention factor, on seeded
random configs), how configs write it (rope_scaling, transformers 5's rope_parameters, hf_overrides), the max_model_len
it allows, and a YaRN-scaled tiny Llama's logits against HF's."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxserve import LLM, SamplingParams
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.config import ModelConfig, hf_overrides_from_json
from jaxserve.engine_config import EngineConfig
from jaxserve.model.rope import apply_rope, rope_parameters
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.runner.steps import Steps
from jaxserve.weights import load_model

from hf_models import save_tiny_model


def _random_scaling(rng, kind: str, mpe: int) -> dict:
    scaling = {"rope_type": kind, "factor": float(rng.choice([2.0, 4.0, 8.0, 32.0]) * rng.uniform(1, 1.5))}
    if kind == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=float(rng.choice([2.0, 4.0])),
                       original_max_position_embeddings=mpe // 2)
    if kind != "yarn":
        return scaling
    # Every optional YaRN key, present or not: the original context (default max_position_embeddings), the ramp's
    # betas, truncate, and the attention factor given, from mscale / mscale_all_dim, from mscale alone (ignored), or
    # from the factor.
    if rng.random() < 0.7:
        scaling["original_max_position_embeddings"] = mpe // int(rng.choice([1, 2, 4]))
    if rng.random() < 0.5:
        scaling["beta_fast"] = float(rng.uniform(8, 64))
    if rng.random() < 0.5:
        scaling["beta_slow"] = float(rng.uniform(0.5, 2))
    if rng.random() < 0.4:
        scaling["truncate"] = bool(rng.random() < 0.5)
    r = rng.random()
    if r < 0.25:
        scaling["attention_factor"] = float(rng.uniform(0.5, 2))
    elif r < 0.5:
        scaling.update(mscale=float(rng.uniform(0.5, 1.5)), mscale_all_dim=float(rng.uniform(0.5, 1.5)))
    elif r < 0.6:
        scaling["mscale"] = float(rng.uniform(0.5, 1.5))
    return scaling


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn", "dynamic"])
def test_frequencies_and_attention_factor_match_hf(kind):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(25):
        head_dim = int(rng.choice([16, 32, 64, 128, 256]))
        theta = float(rng.choice([1e4, 1e5, 5e5, 1e6]) * rng.uniform(0.5, 2))
        mpe = int(rng.choice([2048, 4096, 8192, 32768]))
        scaling = _random_scaling(rng, kind, mpe)
        hf_config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                             max_position_embeddings=mpe,
                                             rope_parameters={**scaling, "rope_theta": theta})
        # Dynamic NTK: jaxserve fixes the base at factor x max_position_embeddings (vLLM's); HF's equals it there.
        at = {"seq_len": scaling["factor"] * mpe} if kind == "dynamic" else {}
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", **at)
        got, factor = rope_parameters(head_dim, theta, scaling, mpe)
        msg = f"seed {seed}: {scaling}, head_dim {head_dim}, theta {theta}, max_position_embeddings {mpe}"
        assert got.dtype == np.float32 and got.shape == (head_dim // 2,), msg
        # HF computes in float32, jaxserve in float64 rounded once: equal to float32 rounding.
        np.testing.assert_allclose(got, want.numpy(), rtol=5e-6, atol=0, err_msg=msg)
        assert factor == pytest.approx(want_factor, rel=1e-12, abs=1e-12), msg


def test_dynamic_ntk_stretches_the_base():
    """HF's dynamic NTK at max_position_embeddings is plain RoPE; jaxserve's base is fixed where the scaling ends."""
    plain, _ = rope_parameters(64, 10000.0, None, 2048)
    dynamic, factor = rope_parameters(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0}, 2048)
    assert factor == 1.0 and dynamic[0] == plain[0] and (dynamic[1:] < plain[1:]).all()


def test_attention_factor_scales_cos_and_sin():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    positions, inv_freq = jnp.arange(5), rope_parameters(8, 100.0, None, 16)[0]
    np.testing.assert_allclose(apply_rope(x, positions, inv_freq, 1.5), 1.5 * apply_rope(x, positions, inv_freq),
                               rtol=1e-6)


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
_HF = dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=16, intermediate_size=32,
           num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=40960, rope_theta=1e6)


def test_config_reads_both_ways_configs_write_rope_scaling():
    old = ModelConfig.from_hf_config({**_HF, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768}})
    new = ModelConfig.from_hf_config({k: v for k, v in _HF.items() if k != "rope_theta"}
                                     | {"rope_parameters": {**_YARN, "rope_theta": 1e6}})
    for config in (old, new):
        assert config.rope_theta == 1e6 and dict(config.rope_scaling)["factor"] == 4.0
        assert config.derived_max_model_len == 131072  # as vLLM: original x factor, not max_position_embeddings
    assert ModelConfig.from_hf_config(_HF).derived_max_model_len == 40960
    dynamic = ModelConfig.from_hf_config({**_HF, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert dynamic.derived_max_model_len == 81920
    # A Gemma 3 config of transformers 4 keeps its (global layers') scaling beside the local base.
    gemma = ModelConfig.from_hf_config({**_HF, "architectures": ["Gemma3ForCausalLM"], "head_dim": 8,
                                        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                        "rope_local_base_freq": 10000.0})
    assert dict(gemma.rope_scaling)["factor"] == 8.0 and gemma.derived_max_model_len == 40960
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_config({**_HF, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="factor >= 1"):
        ModelConfig.from_hf_config({**_HF, "rope_scaling": {"rope_type": "linear"}})


def test_hf_overrides():
    base = ModelConfig.from_hf_config(_HF)
    assert base.with_hf_overrides(None) is base
    yarn = base.with_hf_overrides({"rope_scaling": _YARN})
    assert dict(yarn.rope_scaling) == _YARN and yarn.derived_max_model_len == 131072 and yarn.rope_theta == 1e6
    # transformers 5's key, its base inside; and a default rope_parameters takes the scaling away again.
    new = base.with_hf_overrides({"rope_parameters": {**_YARN, "rope_theta": 5e5}})
    assert new.rope_theta == 5e5 and dict(new.rope_scaling)["factor"] == 4.0
    assert yarn.with_hf_overrides({"rope_parameters": {"rope_type": "default"}}).rope_scaling is None
    assert yarn.with_hf_overrides({"max_position_embeddings": 4096}).max_position_embeddings == 4096
    with pytest.raises(ValueError, match="cannot set 'num_hidden_layers'"):
        base.with_hf_overrides({"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="yarn"):
        EngineConfig(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 0.5}})
    with pytest.raises(TypeError, match="dict"):
        EngineConfig(hf_overrides="yarn")
    assert hf_overrides_from_json(json.dumps({"rope_scaling": _YARN})) == {"rope_scaling": _YARN}
    for bad in ("{not json", "[1]"):
        with pytest.raises(ValueError, match="JSON object"):
            hf_overrides_from_json(bad)


def test_hf_overrides_flag():
    from jaxserve.cli import build_parser
    args = build_parser().parse_args(["serve", "--hf-overrides", json.dumps({"rope_scaling": _YARN}),
                                      "--max-model-len", "65536"])
    config = EngineConfig.from_cli_args(args)
    assert config.hf_overrides == {"rope_scaling": _YARN} and config.max_model_len == 65536


def _yarn_llama(tmp_path, **scaling):
    """A tiny Llama (native context 256) saved plain, and HF's model of it with YaRN applied through its config."""
    path = tmp_path / "llama"
    save_tiny_model("llama", path)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    hf_config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, **scaling}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=torch.float32).eval()
    return path, hf


def test_yarn_tiny_llama_logits_match_hf(tmp_path):
    """Positions past the native 256, YaRN set as vLLM users set it (hf_overrides): HF's logits."""
    scaling = {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0}
    path, hf = _yarn_llama(tmp_path, **scaling)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    prompt = np.random.default_rng(seed).integers(0, hf.config.vocab_size, size=300).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()  # [T, V]
    loaded = load_model(str(path), jnp.float32)
    config = loaded.config.with_hf_overrides({"rope_scaling": {"rope_type": "yarn", **scaling}})
    page_size, num_pages = 16, pages_needed(len(prompt), 16)
    batch = build_batch([Row(prompt, 0, list(range(1, 1 + num_pages)))], page_size, config.vocab_size, 304, 1,
                        num_pages)
    got, _ = Steps(config, jnp.float32).forward_logits(
        loaded.params, init_kv_cache(config, num_pages + 1, page_size, jnp.float32), batch)
    got = np.asarray(got[:len(prompt)])
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 1e-4, f"seed {seed}: relative error {err}"
    # Without the attention factor (or the scaled frequencies) it would be far off: the test sees YaRN.
    plain, _ = Steps(loaded.config, jnp.float32).forward_logits(
        loaded.params, init_kv_cache(config, num_pages + 1, page_size, jnp.float32), batch)
    assert np.max(np.abs(np.asarray(plain[:len(prompt)]) - want)) / np.max(np.abs(want)) > 1e-2


def test_max_model_len_past_native_context_needs_scaling(tmp_path):
    path = tmp_path / "llama"
    save_tiny_model("llama", path)  # native context 256
    with pytest.raises(ValueError, match=r"\[2, 256\].*rope_scaling"):
        LLM(str(path), dtype="float32", max_model_len=512, warmup=False)
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
    with pytest.raises(ValueError, match=r"\[2, 1024\]"):
        LLM(str(path), dtype="float32", hf_overrides=yarn, max_model_len=2048, warmup=False)
    llm = LLM(str(path), dtype="float32", hf_overrides=yarn, max_model_len=1024, block_size=16,
              max_num_batched_tokens=512, warmup=False)
    assert llm.max_model_len == 1024 and dict(llm.config.rope_scaling)["factor"] == 4.0
    out = llm.generate([{"prompt_token_ids": list(range(1, 301))}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
