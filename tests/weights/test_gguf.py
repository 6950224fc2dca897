import math

import gguf
import numpy as np
import pytest

from jaxserve.weights.gguf import load_gguf


@pytest.fixture(scope="module")
def ours(default_gguf_path):
    return load_gguf(default_gguf_path)


@pytest.fixture(scope="module")
def hf(hf_default_model):
    return hf_default_model.config, {k: v.numpy() for k, v in hf_default_model.state_dict().items()}


def test_config(ours, hf):
    config, _, _ = ours
    hf_config, _ = hf
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings and not config.attention_bias
    for ours_name, hf_name in [("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
                               ("num_kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"),
                               ("intermediate_size", "intermediate_size"),
                               ("tie_word_embeddings", "tie_word_embeddings")]:
        assert getattr(config, ours_name) == getattr(hf_config, hf_name), ours_name
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)


def test_tensors_equal_hf(ours, hf):
    """Every tensor, q_proj and k_proj included (llama.cpp permutes their rows; a wrong un-permute still
    generates fluent text), equals what HF transformers loads from the same file."""
    _, params, _ = ours
    _, state = hf
    assert set(params) == set(state) - {"lm_head.weight"}  # tied: HF lists the embedding a second time
    for name, w in params.items():
        assert w.dtype == np.float32 and w.flags.c_contiguous, name
        np.testing.assert_array_equal(w, state[name], err_msg=name)
    assert params["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert params["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_tokenizer_attached(ours):
    tokenizer = ours[2]
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_bad_files(tmp_path, default_gguf_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "random.gguf").write_bytes(np.random.default_rng(0).bytes(100_000))
    with open(default_gguf_path, "rb") as f:
        (tmp_path / "header_only.gguf").write_bytes(f.read(1_000))
        (tmp_path / "truncated.gguf").write_bytes(f.read(20_000_000))
    for name, message in [("missing.gguf", "does not exist"), ("empty.gguf", "not a valid GGUF"),
                          ("random.gguf", "not a valid GGUF"), ("header_only.gguf", "not a valid GGUF"),
                          ("truncated.gguf", "not a valid GGUF"), (".", "not a file")]:
        with pytest.raises(ValueError, match=message) as e:
            load_gguf(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)


# Tiny synthetic files cover what the default model does not: qwen2 (biases, no permutation, untied),
# Llama 3 RoPE scaling stored as `rope_freqs`, linear scaling, unknown architectures.
H, N_HEAD, N_KV, FF, V = 16, 4, 2, 24, 4


def _permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny(path, arch, *, bias=False, untied=False, rope_freqs=None, linear=None, yarn=None):
    """yarn: {GGUFWriter.add_rope_scaling_<key>: value} (factor, orig_ctx_len, yarn_beta_fast, ...)."""
    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": rng.standard_normal((V, H)), "model.norm.weight": rng.standard_normal(H)}
    kv = H // N_HEAD * N_KV
    for name, shape in [("q_proj", (H, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, H)),
                        ("gate_proj", (FF, H)), ("up_proj", (FF, H)), ("down_proj", (H, FF))]:
        block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        hf[f"model.layers.0.{block}.{name}.weight"] = rng.standard_normal(shape)
    hf["model.layers.0.input_layernorm.weight"] = rng.standard_normal(H)
    hf["model.layers.0.post_attention_layernorm.weight"] = rng.standard_normal(H)
    if bias:
        hf["model.layers.0.self_attn.q_proj.bias"] = rng.standard_normal(H)
        hf["model.layers.0.self_attn.k_proj.bias"] = rng.standard_normal(kv)
        hf["model.layers.0.self_attn.v_proj.bias"] = rng.standard_normal(kv)
    if untied:
        hf["lm_head.weight"] = rng.standard_normal((V, H))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if linear:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        for key, value in yarn.items():
            getattr(w, "add_rope_scaling_" + key)(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(["a", "b", "ab", "<|eot_id|>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in hf.items():
        g = name.replace("model.layers.", "blk.")
        for a, b in names.items():
            g = g.replace(a, b)
        if arch == "llama" and ".attn_q." in g:
            t = _permute(t, N_HEAD)
        elif arch == "llama" and ".attn_k." in g:
            t = _permute(t, N_KV)
        w.add_tensor(g, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _check(path, expected):
    config, params, tokenizer = load_gguf(path)
    assert set(params) == set(expected)
    for name, w in params.items():
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
    assert tokenizer.eos_token_ids == [3]
    return config


def test_qwen2(tmp_path):
    expected = _tiny(tmp_path / "q.gguf", "qwen2", bias=True, untied=True)
    config = _check(tmp_path / "q.gguf", expected)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and not config.tie_word_embeddings
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 4, V)
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 500000.0 and config.max_position_embeddings == 4096


def test_llama3_rope_freqs(tmp_path):
    # What llama.cpp's converter writes for Llama 3.1 (factor 8, low 1, high 4, original context 8192).
    head_dim, factor, low, high, ctx = H // N_HEAD, 8.0, 1.0, 4.0, 8192
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / head_dim)
        if wavelen < ctx / high:
            factors.append(1.0)
        elif wavelen > ctx / low:
            factors.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    expected = _tiny(tmp_path / "l.gguf", "llama", rope_freqs=np.array(factors, np.float32))
    config = _check(tmp_path / "l.gguf", expected)
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    assert dict(config.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    assert 1 < factors[1] < factor  # no frequency gets the full factor: it must be inferred from the band
    _tiny(tmp_path / "bad.gguf", "llama", rope_freqs=np.array([1.5, 3.0], np.float32))
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(tmp_path / "bad.gguf")


def test_llama3_rope_freqs_smooth_band():
    from jaxserve.weights.gguf import _llama3_rope_scaling
    theta, head_dim = 500000.0, 128
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (8192 / wavelen - 1) / 3
    factors = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    assert ((factors > 1) & (factors < 8)).any()
    assert _llama3_rope_scaling(factors.astype(np.float32), theta, head_dim)["factor"] == 8.0
    assert _llama3_rope_scaling(np.ones(4, np.float32), 10.0, 8) is None  # all frequencies above the band


def test_linear_rope_and_unknown_arch(tmp_path):
    _tiny(tmp_path / "lin.gguf", "llama", linear=2.0)
    assert dict(load_gguf(tmp_path / "lin.gguf")[0].rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    _tiny(tmp_path / "g.gguf", "gemma")
    with pytest.raises(ValueError, match="unsupported architecture 'gemma'"):
        load_gguf(tmp_path / "g.gguf")


def test_yarn_rope_metadata(tmp_path):
    """The keys llama.cpp's converter writes for a HF config's YaRN (gguf-py Keys.Rope), back to HF's rope_scaling."""
    _tiny(tmp_path / "y.gguf", "qwen2", bias=True, yarn={"factor": 4.0, "orig_ctx_len": 1024, "yarn_beta_fast": 16.0,
                                                          "yarn_beta_slow": 2.0, "yarn_attn_factor": 0.5})
    config = load_gguf(tmp_path / "y.gguf")[0]
    assert dict(config.rope_scaling) == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                         "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 0.5}
    assert config.derived_max_model_len == 4096
    _tiny(tmp_path / "bare.gguf", "llama", yarn={"factor": 2.0})  # the original context: the context length
    config = load_gguf(tmp_path / "bare.gguf")[0]
    assert dict(config.rope_scaling) == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    assert config.derived_max_model_len == 8192
    for knob in ({"yarn_ext_factor": 0.5}, {"yarn_log_mul": 0.1}):
        _tiny(tmp_path / "knob.gguf", "llama", yarn={"factor": 2.0, **knob})
        with pytest.raises(ValueError, match="not supported"):
            load_gguf(tmp_path / "knob.gguf")
