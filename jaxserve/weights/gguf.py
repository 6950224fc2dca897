"""Load a llama.cpp GGUF file: config from its metadata, float32 weights under HF transformers' names, tokenizer."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.tokenizer import Tokenizer

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms both sides of attention and FFN: its `ffn_norm` is the pre-FFN norm, which Llama calls
# post_attention_layernorm; HF's Gemma uses that name for the norm on the attention's output.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GEMMA3_CHAT_TEMPLATE = Path(__file__).parent.parent / "data" / "gemma3_chat_template.jinja"
_MISSING = object()


def _hf_name(name: str, arch: str) -> str | None:
    base, kind = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        return f"model.layers.{layer}.{layer_names[part]}.{kind}" if part in layer_names else None
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two rotary halves (for its pairwise RoPE); undo it so the
    # weights fit HF's rotate-half RoPE.
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(freq_factors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """Llama 3.1+ GGUFs carry their RoPE scaling as per-frequency factors (`rope_freqs`), not as metadata.

    Recover HF's `llama3` rope_scaling: the only low/high/original-context values Meta has shipped are 1, 4 and
    8192; `factor` follows from the lowest frequency, and all factors are checked against the result.
    """
    ctx, low, high = 8192, 1.0, 4.0
    wavelen = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((ctx / wavelen - low) / (high - low), 0.0, 1.0)  # 1: unscaled, 0: scaled by `factor`
    if freq_factors.shape != smooth.shape:
        raise ValueError(f"rope_freqs has {freq_factors.size} entries, expected head_dim / 2 = {smooth.size}")
    if smooth.min() == 1.0:  # every frequency is above the band: scaling changes nothing
        return None
    i = int(np.argmin(smooth))  # factors are 1 / ((1 - smooth) / factor + smooth)
    factor = round(float((1 - smooth[i]) / (1 / freq_factors[i] - smooth[i])), 3)
    if not np.allclose(freq_factors, 1 / ((1 - smooth) / factor + smooth), rtol=1e-4):
        raise ValueError("unsupported rope_freqs tensor: its factors are not Llama 3 RoPE scaling")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": ctx}


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of the file mapping.

    The reader slices its buffer once per vocabulary string (~100k of them); on an np.memmap every slice pays for
    the subclass's bookkeeping, which made parsing 2-3x slower (2.2 s vs 0.7-1.0 s for the default model).
    """

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)  # still backed by, and keeping alive, the memory map


def open_gguf(path) -> gguf.GGUFReader:
    """A reader over a GGUF file's metadata and (memory-mapped) tensors; ValueError naming the file if it is bad."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        return _Reader(path)
    except Exception as e:  # bad magic, empty, or truncated (the header then promises more data than there is)
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {e}") from None


def load_gguf(path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Config, float32 weights in HF layout and names (out_features, in_features), and tokenizer of a GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    meta = _metadata(reader, path)
    arch = meta("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {arch!r}; jaxserve reads {', '.join(_ARCHITECTURES)} GGUFs")
    tokenizer = _tokenizer(reader, path, arch)
    hidden = meta(f"{arch}.embedding_length")
    n_heads = meta(f"{arch}.attention.head_count")
    n_kv_heads = meta(f"{arch}.attention.head_count_kv", n_heads)
    head_dim = meta(f"{arch}.attention.key_length", hidden // n_heads)
    rope_theta = meta(f"{arch}.rope.freq_base", 10000.0)
    names = _tensor_names(reader, path, arch)
    params = _load_tensors(reader, path, arch, names, n_heads, n_kv_heads)
    rope_scaling = _rope_scaling(meta, params, path, arch, rope_theta, head_dim)
    if arch == "gemma3":
        return _gemma3_config(meta, params, rope_scaling), params, tokenizer
    config = ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=params["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta(f"{arch}.feed_forward_length"),
        num_layers=meta(f"{arch}.block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen2" else 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=meta(f"{arch}.context_length", 2048),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in params,
        tie_word_embeddings="lm_head.weight" not in params,
    )
    return config, params, tokenizer


def _metadata(reader: gguf.GGUFReader, path: Path):
    """meta(key, default): a metadata value; ValueError naming the file if it is missing and no default is given."""
    def meta(key, default=_MISSING):
        field = reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"{path}: GGUF metadata has no {key!r}")
            return default
        value = field.contents()
        # float32 metadata (1e-5 is stored as 9.99999974e-06): take the shortest decimal that rounds to it, as the
        # model's config.json has it.
        return float(str(np.float32(value))) if isinstance(value, float) else value
    return meta


def _tokenizer(reader: gguf.GGUFReader, path: Path, arch: str) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_gguf_fields(reader)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if arch == "gemma3" and tokenizer.chat_template is None:  # llama.cpp's converter often leaves Gemma's out
        tokenizer.chat_template = _GEMMA3_CHAT_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def _tensor_names(reader: gguf.GGUFReader, path: Path, arch: str) -> dict[str, str]:
    """gguf name -> HF name of every tensor, checked before the slow part (dequantizing)."""
    names = {}
    for t in reader.tensors:
        names[t.name] = "rope_freqs" if t.name == "rope_freqs.weight" else _hf_name(t.name, arch)
        if names[t.name] is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
    return names


def _load_tensors(reader: gguf.GGUFReader, path: Path, arch: str, names: dict[str, str], n_heads: int,
                  n_kv_heads: int) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 in HF's layout, by HF name."""
    def load(t):
        return names[t.name], _hf_tensor(t, names[t.name], arch, n_heads, n_kv_heads)

    try:
        with ThreadPoolExecutor(os.cpu_count()) as pool:  # numpy releases the GIL while dequantizing
            return dict(pool.map(load, reader.tensors))
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{path}: cannot dequantize its tensors: {e}") from None


def _hf_tensor(t, name: str, arch: str, n_heads: int, n_kv_heads: int) -> np.ndarray:
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    # Unquantized tensors come back as views of the memory-mapped file: copy them out.
    w = np.array(w, dtype=np.float32, copy=np.may_share_memory(w, t.data))
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = _unpermute(w, n_heads)
    elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = _unpermute(w, n_kv_heads)
    elif arch == "gemma3" and name.endswith("norm.weight"):
        # llama.cpp's converter bakes Gemma's RMSNorm offset into the weight (it computes x * w); HF keeps the
        # checkpoint's w and computes x * (1 + w).
        w -= 1.0
    return w


def _rope_scaling(meta, params: dict[str, np.ndarray], path: Path, arch: str, rope_theta: float,
                  head_dim: int) -> dict | None:
    """HF's rope_scaling from the `rope_freqs` tensor (popped from params: it is no weight) or the metadata."""
    scaling_type = meta(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs" in params:
        try:
            return _llama3_rope_scaling(params.pop("rope_freqs"), rope_theta, head_dim)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": meta(f"{arch}.rope.scaling.factor")}
    if scaling_type == "yarn":
        return _yarn_rope_scaling(meta, path, arch)
    if scaling_type != "none":
        raise ValueError(f"{path}: unsupported RoPE scaling {scaling_type!r}")
    return None


def _yarn_rope_scaling(meta, path: Path, arch: str) -> dict:
    """HF's YaRN rope_scaling from the keys llama.cpp's converter writes (gguf-py's Keys.Rope): the factor, the
    original context (default: the context length, as HF's and llama.cpp's), and where the HF config had them,
    beta_fast / beta_slow and attention_factor (yarn_attn_factor)."""
    key = f"{arch}.rope.scaling."
    scaling = {"rope_type": "yarn", "factor": meta(key + "factor"),
               "original_max_position_embeddings": meta(key + "original_context_length",
                                                        meta(f"{arch}.context_length", 2048))}
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_attn_factor", "attention_factor")):
        if meta(key + gguf_key, None) is not None:
            scaling[hf_key] = meta(key + gguf_key)
    # llama.cpp's knobs HF has no equivalent of: the ramp's weight (1, or its default -1, is HF's YaRN) and
    # DeepSeek's mscale_all_dim (MLA models only); any other value would silently compute something else.
    if meta(key + "yarn_ext_factor", 1.0) not in (1.0, -1.0):
        raise ValueError(f"{path}: YaRN with yarn_ext_factor {meta(key + 'yarn_ext_factor')} is not supported (1 is)")
    if meta(key + "yarn_log_multiplier", 0.0):
        raise ValueError(f"{path}: YaRN with a yarn_log_multiplier (DeepSeek's mscale_all_dim) is not supported")
    return scaling


def _gemma3_config(meta, params, rope_scaling: dict | None) -> ModelConfig:
    """Gemma 3's config as HF writes it, through ModelConfig.from_hf_config (which holds the family's constants).

    What the GGUF does not say is fixed by the architecture, as in llama.cpp and transformers: every 6th layer
    attends globally, the others over the sliding window with RoPE base 10000; RoPE scaling (the 4B-27B GGUFs'
    linear factor 8) applies to the global layers only.
    """
    n_layers, hidden, n_heads = meta("gemma3.block_count"), meta("gemma3.embedding_length"), \
        meta("gemma3.attention.head_count")
    head_dim = meta("gemma3.attention.key_length", 256)
    return ModelConfig.from_hf_config({
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": meta("gemma3.feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta("gemma3.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": params["model.embed_tokens.weight"].shape[0],
        "max_position_embeddings": meta("gemma3.context_length", 32768),
        "sliding_window": meta("gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)],
        # llama.cpp: 27B (62 layers) scales scores by hidden / heads, the other sizes by head_dim.
        "query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else head_dim,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": meta("gemma3.rope.freq_base", 1_000_000.0),
                               **(rope_scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": "lm_head.weight" not in params,
    })
