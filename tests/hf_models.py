"""Tiny random HF checkpoints (written with save_pretrained) for comparing jaxserve with transformers."""
from __future__ import annotations

import shutil

import tokenizers
import torch
import transformers

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.25,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)

VARIANTS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "llama3-rope-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    # Heads enough for tensor parallelism up to 8, with 2 KV heads: split at 2, replicated at 4 and 8.
    "llama-8-heads": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_attention_heads=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1000000.0)),
    # A window shorter than the test prompts, so the sliding-window mask is exercised.
    "mistral-sliding": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=12)),
    # QK-norm, and a head_dim that is not hidden / heads.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, rope_theta=1000000.0)),
    # Sandwich norms, GeGLU, scaled embeddings, QK-norm, a query scale other than head_dim's (256 against 16), and
    # sliding layers (a window shorter than the prompts, their own RoPE base) around a full one.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=16, sliding_window=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def save_tiny_model(kind: str, path, seed: int = 0, **overrides):
    config_cls, model_cls, extra = VARIANTS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():  # norms start at 1 (or Gemma's 0): random ones show a misplaced or misread norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_tiny_chat_model(kind: str, path, chat_template: str, seed: int = 0):
    """A tiny random checkpoint with a tokenizer (the default model's, 49152 tokens) and the given chat template."""
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights.default_model import default_model_path
    from jaxserve.weights.gguf import open_gguf
    tok = Tokenizer.from_gguf_fields(open_gguf(default_model_path()))
    tok.chat_template = chat_template
    model = save_tiny_model(kind, path, seed, vocab_size=tok.vocab_size, max_position_embeddings=1024)
    tok.save(path)
    return model


def with_byte_tokenizer(model_dir: str, path) -> str:
    """A copy of a tiny model's directory at `path` with the byte-level tokenizer (its last id an EOS) added."""
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    save_byte_tokenizer_with_eos(path)
    return str(path)


def save_byte_tokenizer_with_eos(path):
    """A byte-level tokenizer for the tiny model's 320 ids: the 256 bytes, 63 two-byte tokens, and an EOS
    control token (id 319), saved as an HF directory's tokenizer files."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    from jaxserve.tokenizer import Tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({alphabet[i] + alphabet[i + 1]: 256 + i for i in range(63)})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    Tokenizer(tok, bos_token_id=None, eos_token_ids=[319], add_bos=False, chat_template=None).save(path)


def save_tiny_lora(base_path, path, seed: int = 0, scale: float = 0.1, **lora_config):
    """A PEFT LoRA adapter for the checkpoint at base_path, saved to path (adapter_config.json +
    adapter_model.safetensors), its A and B drawn at random (PEFT starts B at zero, which would test nothing).
    lora_config: peft.LoraConfig's arguments (r, lora_alpha, target_modules, use_rslora, layers_to_transform...)."""
    import peft
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(**lora_config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn_like(p))
    lora.save_pretrained(path)
    return path


def peft_model(base_path, adapter_path):
    """HF transformers + PEFT float32: the base checkpoint with the adapter applied (the reference)."""
    import peft
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter_path).eval()
