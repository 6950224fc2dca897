"""Model configuration: the architecture numbers read from a checkpoint, never hard-coded."""
from __future__ import annotations

import dataclasses
import json

from jaxserve.cli_flags import json_object_flag

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types
SUPPORTED_ROPE_SCALING = ("linear", "llama3", "yarn", "dynamic")
# The HF config keys `hf_overrides` may set (vLLM's option): those that change no weight's shape.
HF_OVERRIDABLE = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


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
            _check_rope_scaling(dict(self.rope_scaling))
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

    @property
    def derived_max_model_len(self) -> int:
        """The longest max_model_len the model takes, as vLLM derives it: its max_position_embeddings, stretched by
        RoPE scaling: YaRN's original_max_position_embeddings x factor, linear's and dynamic NTK's
        max_position_embeddings x factor (not Gemma 3's: its configs write the scaled length already, as llama3's
        do)."""
        scaling = dict(self.rope_scaling or ())
        kind = rope_type(scaling)
        if kind == "yarn" and scaling.get("factor") is not None:
            original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            return int(original * scaling["factor"])
        if kind in ("linear", "dynamic") and self.architecture != "Gemma3ForCausalLM":
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings

    def with_hf_overrides(self, overrides: dict | None) -> "ModelConfig":
        """This config with HF config keys replaced, as vLLM's `hf_overrides` (each key's value replaces the
        config's, then the model's settings are read from it): the keys of HF_OVERRIDABLE, which change no weight's
        shape. A GGUF's config is overridden the same way (as the HF config it would be)."""
        if not overrides:
            return self
        check_hf_overrides(overrides)
        cfg = {"rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
               "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None}
        if {"rope_scaling", "rope_parameters"} & set(overrides):  # either replaces the RoPE setting
            cfg.pop("rope_scaling")
        cfg.update(overrides)
        theta, scaling, by_type = _hf_rope(cfg, self.architecture)
        local = by_type.get(SLIDING, {}).get("rope_theta") if self.rope_local_theta is not None else None
        return dataclasses.replace(self, rope_theta=theta, rope_scaling=scaling,
                                   max_position_embeddings=cfg["max_position_embeddings"],
                                   rope_local_theta=self.rope_local_theta if local is None else local)

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
        rope_theta, rope_scaling, by_type = _hf_rope(cfg, arch)
        use_sliding = cfg.get("use_sliding_window", arch in ("MistralForCausalLM", "Gemma3ForCausalLM"))
        layer_types = cfg.get("layer_types") if use_sliding else None
        family = {}
        if arch == "Qwen3ForCausalLM":
            family = dict(qk_norm=True)
        elif arch == "Gemma3ForCausalLM":
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
            rope_theta=rope_theta,
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


def rope_type(scaling) -> str:
    """HF's rope_type of a rope_scaling dict (or its items), the legacy key `type` included; "default" for none."""
    scaling = dict(scaling or ())
    return scaling.get("rope_type", scaling.get("type", "default"))


def _hf_rope(cfg: dict, arch: str) -> tuple[float, dict | None, dict]:
    """(rope_theta, rope_scaling or None, RoPE settings by layer type) of a HF config. transformers >= 5 writes
    `rope_parameters` (the base inside; Gemma 3's one per layer type, the scaling on the global layers'), older
    configs `rope_theta` and `rope_scaling` (a flat dict; on Gemma 3 it scales the global layers)."""
    params = cfg.get("rope_parameters") or {}
    by_type = params if FULL in params or SLIDING in params else {}
    if by_type:
        params = by_type.get(FULL) or {}
    default_theta = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
    theta = params.get("rope_theta", cfg.get("rope_theta")) or default_theta
    scaling = params if rope_type(params) != "default" else cfg.get("rope_scaling")
    return theta, (None if rope_type(scaling) == "default" else scaling), by_type


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rope_scaling(scaling: dict) -> None:
    """A clear error for a rope_scaling jaxserve would misread or fail on deep in the model."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"unsupported rope scaling {kind!r}; jaxserve supports {', '.join(SUPPORTED_ROPE_SCALING)}")
    factor = scaling.get("factor")
    if (factor is not None or kind != "yarn") and not (_is_number(factor) and factor >= 1):
        raise ValueError(f"rope_scaling {kind!r} needs a factor >= 1, got {factor!r}")
    needed = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}.get(kind, ())
    missing = [key for key in needed if not _is_number(scaling.get(key))]
    if missing:
        raise ValueError(f"rope_scaling {kind!r} needs {', '.join(missing)} (numbers), got {scaling}")
    for key in ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
                "mscale_all_dim"):
        if scaling.get(key) is not None and not (_is_number(scaling[key]) and scaling[key] >= 0):
            raise ValueError(f"rope_scaling's {key} must be a non-negative number, got {scaling[key]!r}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")


def check_hf_overrides(overrides) -> None:
    """hf_overrides' checks that need no model: None, or a dict of overridable keys, each of a sensible type."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise TypeError(f"hf_overrides must be a dict of HF config keys, got {overrides!r}")
    unknown = sorted(set(overrides) - set(HF_OVERRIDABLE))
    if unknown:
        raise ValueError(f"hf_overrides cannot set {', '.join(map(repr, unknown))}: jaxserve overrides "
                         f"{', '.join(HF_OVERRIDABLE)} (the keys that change no weight's shape)")
    for key in ("rope_scaling", "rope_parameters"):
        if overrides.get(key) is not None and not isinstance(overrides[key], dict):
            raise TypeError(f"hf_overrides' {key} must be a dict (or null), got {overrides[key]!r}")
    scaling = overrides.get("rope_scaling")
    if scaling and rope_type(scaling) != "default":
        _check_rope_scaling(scaling)
    if "rope_theta" in overrides and not (_is_number(overrides["rope_theta"]) and overrides["rope_theta"] > 0):
        raise ValueError(f"hf_overrides' rope_theta must be a positive number, got {overrides['rope_theta']!r}")
    mpe = overrides.get("max_position_embeddings", 1)
    if not (isinstance(mpe, int) and not isinstance(mpe, bool) and mpe >= 1):
        raise ValueError(f"hf_overrides' max_position_embeddings must be a positive integer, got {mpe!r}")


def hf_overrides_from_json(text: str | None) -> dict | None:
    """`--hf-overrides JSON` (vLLM's flag): a JSON object, checked as check_hf_overrides does."""
    if text is None:
        return None
    overrides = json_object_flag("--hf-overrides", text, '{"rope_scaling": {...}}')
    check_hf_overrides(overrides)
    return overrides
