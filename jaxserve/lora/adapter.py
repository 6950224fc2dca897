"""A PEFT LoRA adapter read from its directory (adapter_config.json + adapter_model.safetensors) into host arrays,
checked against the base model it is to run on.

Per layer and target linear layer the adapter adds x @ A @ B * scaling to the layer's output (PEFT's LoRA). The
scaling (lora_alpha / r, or rsLoRA's lora_alpha / sqrt(r); alpha_pattern and rank_pattern per module) is folded
into B here, so the device computes x @ A @ B alone. A target or a layer the adapter leaves out is zero.
Anything that would change the model in another way (DoRA, trained biases, embeddings, the LM head, modules to
save) is refused rather than silently dropped.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora.request import LoRARequest
from jaxserve.model.families import LINEARS

TARGETS = tuple(LINEARS)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
_CHECKPOINT_NAME = {v: k for k, v in LINEARS.items()}  # "self_attn.q_proj" -> "q_proj"
# A LoRA weight of a decoder layer's linear, as PEFT saves it (its adapter name left out of the keys), under a
# causal LM's (model.layers) or a multimodal model's language model's (model.language_model.layers) prefix.
_KEY = re.compile(r"base_model\.model\.(?P<module>(?:model\.)?(?:language_model\.)?layers\.(?P<layer>\d+)\."
                  r"(?P<linear>(?:self_attn|mlp)\.[a-z_]+))\.lora_(?P<which>[AB])\.weight")


class LoRAError(ValueError):
    """An adapter that cannot run on this model: the message names the adapter and what is wrong."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    id: int
    rank: int  # the largest of its targets' ranks
    # (layer, target) -> (A [in, r], B [r, out] with the scaling folded in); a pair left out is zero.
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@functools.cache
def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's base kernel [in, out], as the model declares it (the same in every layer)."""
    from jaxserve.model.decoder import declared_params
    layer = declared_params(config).shapes["params"]["layers_0"]
    return {t: tuple(layer[t]["kernel"].shape) for t in TARGETS}


def load_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int, dtype=np.float32) -> LoRAAdapter:
    """The adapter at request.lora_path, for a model of `config` (as loaded: before any tensor-parallel KV-head
    repetition), its arrays in `dtype` (float32, or the model's). Raises LoRAError."""
    path = Path(request.lora_path)

    def fail(field: str, why: str):
        raise LoRAError(f"LoRA adapter {request.lora_name!r} ({path}): {field}: {why}")

    settings = _read_config(path, fail)
    tensors = _read_tensors(path, fail)
    shapes = target_shapes(config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, value in tensors.items():
        m = _KEY.fullmatch(key)
        target = _CHECKPOINT_NAME.get(m["linear"]) if m else None
        if target is None:
            fail(key, "not a LoRA weight of a decoder layer's q/k/v/o/gate/up/down_proj (embeddings, the LM head, "
                      "DoRA magnitudes and biases are not supported)")
        layer = int(m["layer"])
        if layer >= config.num_layers:
            fail(key, f"layer {layer}, but the model has {config.num_layers}")
        if value.ndim != 2:
            fail(key, f"a {value.ndim}-d array; LoRA weights are matrices")
        pairs.setdefault((layer, target), {})[m["which"]] = value
        modules[layer, target] = m["module"]
    weights = {}
    for (layer, target), pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        field = f"layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            fail(field, f"lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]  # PEFT's [r, in] and [out, r]
        n_in, n_out = shapes[target]
        r = a.shape[0]
        if a.shape[1] != n_in or b.shape[0] != n_out:
            fail(field, f"lora_A {a.shape} and lora_B {b.shape} do not fit the base layer's [{n_out}, {n_in}] "
                        "(an adapter for another model?)")
        if b.shape[1] != r:
            fail(field, f"lora_A's rank {r} is not lora_B's {b.shape[1]}")
        if r > max_lora_rank:
            fail(field, f"rank {r} is above max_lora_rank {max_lora_rank}")
        want_r, alpha = settings.rank_and_alpha(modules[layer, target])
        if want_r != r:
            fail(field, f"rank {r} in the weights, {want_r} in adapter_config.json")
        scaling = alpha / (math.sqrt(r) if settings.use_rslora else r)
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
            fail(field, "holds non-finite values")
        weights[layer, target] = (np.ascontiguousarray(a32.T, dtype=dtype),
                                  np.ascontiguousarray((b32 * np.float32(scaling)).T, dtype=dtype))
    if not weights:
        fail("adapter_model.safetensors", "holds no LoRA weights")
    return LoRAAdapter(request.lora_name, request.lora_int_id, max(a.shape[1] for a, _ in weights.values()),
                       weights)


@dataclasses.dataclass(frozen=True)
class _Settings:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """PEFT's per-module overrides: a pattern key matches a module whose name ends with it (at a dot)."""
        def lookup(patterns: dict, default):
            for key, value in patterns.items():
                if re.match(rf"(.*\.)?({key})$", module):
                    return value
            return default
        return lookup(self.rank_pattern, self.r), lookup(self.alpha_pattern, self.lora_alpha)


# Settings that would make the adapter something else than x @ A @ B * scaling on the decoder's linears: each is
# refused unless it holds its default (the value that changes nothing).
_UNSUPPORTED = {
    "use_dora": (False, "DoRA"),
    "modules_to_save": (None, "modules trained in full"),
    "bias": ("none", "trained biases"),
    "lora_bias": (False, "a bias on lora_B"),
    "fan_in_fan_out": (False, "transposed (Conv1D) base weights"),
    "trainable_token_indices": (None, "trained token embeddings"),
    "target_parameters": (None, "LoRA on parameters rather than modules"),
    "layer_replication": (None, "replicated layers"),
    "alora_invocation_tokens": (None, "activated LoRA"),
    "use_qalora": (False, "QA-LoRA's pooled inputs"),
    "use_bdlora": (None, "block-diagonal LoRA"),
    "arrow_config": (None, "Arrow routing"),
    "kasa_config": (None, "KaSA"),
    "monteclora_config": (None, "MonteCLoRA"),
}


def _read_config(path: Path, fail) -> _Settings:
    file = path / "adapter_config.json"
    if not file.is_file():
        fail("adapter_config.json", "missing (is the path a PEFT adapter directory?)")
    try:
        c = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail("adapter_config.json", f"unreadable: {e}")
    if not isinstance(c, dict):
        fail("adapter_config.json", "not a JSON object")
    if c.get("peft_type", "LORA") != "LORA":
        fail("peft_type", f"{c['peft_type']!r}; only LORA adapters are supported")
    for field, (default, what) in _UNSUPPORTED.items():
        value = c.get(field, default)
        if value != default and not (default is None and value in ([], {})):
            fail(field, f"{value!r} is not supported ({what})")
    r, alpha = c.get("r"), c.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        fail("r", f"must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        fail("lora_alpha", f"must be a number, got {alpha!r}")
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = c.get(field) or {}
        if not isinstance(value, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            fail(field, f"must map module patterns to numbers, got {value!r}")
        patterns[field] = value
    use_rslora = c.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        fail("use_rslora", f"must be true or false, got {use_rslora!r}")
    return _Settings(r, float(alpha), use_rslora, **patterns)


def _read_tensors(path: Path, fail) -> dict[str, np.ndarray]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        fail("adapter_model.safetensors", "missing (only safetensors adapters are read)")
    import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16", without which a bf16 adapter is a TypeError
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        fail("adapter_model.safetensors", f"unreadable: {e}")
