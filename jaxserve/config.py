"""Model configuration: the architecture numbers read from a checkpoint, never hard-coded."""
from __future__ import annotations

import dataclasses
import json

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
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

    def __post_init__(self):
        # Stored as sorted items so the config stays hashable (it keys jitted step functions).
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        elif self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(tuple(kv) for kv in self.rope_scaling))
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
            if kind not in SUPPORTED_ROPE_SCALING:
                raise ValueError(f"unsupported rope scaling {kind!r}; jaxserve supports {', '.join(SUPPORTED_ROPE_SCALING)}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; jaxserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

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
        use_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            sliding_window=cfg.get("sliding_window") if use_sliding else None,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls(**json.loads(text))
