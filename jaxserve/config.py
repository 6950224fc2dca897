"""Model configuration: the architecture numbers read from a checkpoint, never hard-coded."""
from __future__ import annotations

import dataclasses
import json

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types
SUPPORTED_ROPE_SCALING = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE.
    rope_scaling: dict | tuple | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # What a family's layer does differently from Llama's (architecture as data; see jaxserve.model.decoder).
    hidden_activation: str = "silu"  # the gated FFN's: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # also norms on the attention's and the FFN's outputs (Gemma 3)
    embedding_multiplier: float = 1.0  # embeddings scaled by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scores scaled by this ** -0.5 (None: head_dim's)
    # Per layer FULL or SLIDING (the window is sliding_window); None: every layer sliding if sliding_window is set.
    layer_types: tuple | None = None
    rope_local_theta: float | None = None  # the RoPE base of sliding layers, if it differs (Gemma 3)

    def __post_init__(self):
        # Stored as sorted items so the config stays hashable (it keys jitted step functions).
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        elif self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(tuple(kv) for kv in self.rope_scaling))
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in SUPPORTED_ROPE_SCALING:
                raise ValueError(f"unsupported rope scaling {kind!r}; jaxserve supports "
                                 f"{', '.join(SUPPORTED_ROPE_SCALING)}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; jaxserve supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden activation {self.hidden_activation!r}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
                raise ValueError(f"layer_types must give {FULL!r} or {SLIDING!r} for each of the {self.num_layers} "
                                 f"layers, got {self.layer_types}")

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to the whole context)."""
        if self.layer_types is not None and self.layer_types[i] == FULL:
            return None
        return self.sliding_window

    def layer_rope_theta(self, i: int) -> float:
        if self.rope_local_theta is not None and self.layer_window(i) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a HF `config.json` dict."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 moves rope settings into `rope_parameters`.
        rope_params = cfg.get("rope_parameters")
        if rope_params:
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        use_sliding = cfg.get("use_sliding_window", arch in ("MistralForCausalLM", "Gemma3ForCausalLM"))
        layer_types = cfg.get("layer_types") if use_sliding else None
        family = {}
        if arch == "Qwen3ForCausalLM":
            family = dict(qk_norm=True)
        elif arch == "Gemma3ForCausalLM":
            # transformers >= 5 keeps a RoPE setting per layer type; older configs a local base beside the global.
            by_type = rope_params if rope_params and FULL in rope_params else {}
            full = by_type.get(FULL, {})
            rope_theta = full.get("rope_theta", rope_theta or 1_000_000.0)
            rope_scaling = full if full.get("rope_type", "default") != "default" else None
            family = dict(hidden_activation="gelu_tanh", qk_norm=True, sandwich_norm=True,
                          embedding_multiplier=hidden ** 0.5,
                          query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", cfg.get("head_dim")),
                          rope_local_theta=by_type.get(SLIDING, {}).get("rope_theta",
                                                                        cfg.get("rope_local_base_freq", 10000.0)))
            if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
                raise ValueError("logit soft-capping (Gemma 2) is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if arch == "Gemma3ForCausalLM" else 1e-5),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch == "Gemma3ForCausalLM"),
            sliding_window=cfg.get("sliding_window") if use_sliding else None,
            layer_types=tuple(layer_types) if layer_types else None,
            **family,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls(**json.loads(text))
