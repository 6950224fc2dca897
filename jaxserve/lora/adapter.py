"""A PEFT LoRA adapter read from its directory (adapter_config.json + adapter_model.safetensors) into host arrays,
checked against the base model it is to run on.

Per layer and target linear layer the adapter adds x @ A @ B * scaling to the layer's output (PEFT's LoRA). The
scaling (lora_alpha / r, or rsLoRA's lora_alpha / sqrt(r); alpha_pattern and rank_pattern per module) is folded
into B here, so the device computes x @ A @ B alone. A target or a layer the adapter leaves out is zero.
Anything that would change the model in another way (DoRA, trained biases, embeddings, the LM head, modules to
save) is refused rather than silently dropped.

Adapters come from paths a client names (`/v1/load_lora_adapter`), so reading one is bounded before it starts: see
load_adapter. The server reads them on LOADS, one at a time, apart from the threads that compile grammars.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.lora.patterns import compile_patterns, pattern_value
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.safetensors_header import TensorInfo, read_header
from jaxserve.model.families import LINEARS

logger = logging.getLogger("jaxserve")

TARGETS = tuple(LINEARS)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
_CHECKPOINT_NAME = {v: k for k, v in LINEARS.items()}  # "self_attn.q_proj" -> "q_proj"
# A LoRA weight of a decoder layer's linear, as PEFT saves it (its adapter name left out of the keys), under a
# causal LM's (model.layers) or a multimodal model's language model's (model.language_model.layers) prefix.
_KEY = re.compile(r"base_model\.model\.(?P<module>(?:model\.)?(?:language_model\.)?layers\.(?P<layer>\d+)\."
                  r"(?P<linear>(?:self_attn|mlp)\.[a-z_]+))\.lora_(?P<which>[AB])\.weight")
_DTYPES = ("F32", "F16", "BF16")  # what PEFT saves adapters in
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few kilobytes, a per-module rank_pattern some tens
# The thread the server reads adapters on (AsyncEngine.add_lora): loads queue here rather than each holding a thread
# of the pool that compiles grammars, and one adapter's arrays are in flight at a time.
LOADS = concurrent.futures.ThreadPoolExecutor(1, "lora-load")


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
    repetition), its arrays in `dtype` (float32, or the model's). Raises LoRAError.

    Everything that can be judged without the weights' bytes is judged first, from adapter_config.json and the
    safetensors header (names, dtypes, shapes, ranks, the file's size): a file too large or of the wrong shape is
    refused having read a few kilobytes, and what is read then is the checked tensors alone, at most
    max_lora_rank x the model's shapes. A path that holds no adapter gets one message whatever the reason (missing,
    unreadable, not a PEFT config), so a caller cannot probe the disk with it; the reason goes to the log."""
    path = Path(request.lora_path)

    def fail(field: str, why: str):
        raise LoRAError(f"LoRA adapter {request.lora_name!r} ({path}): {field}: {why}")

    def not_an_adapter(why: str):
        logger.warning("LoRA adapter %r (%s) refused: %s", request.lora_name, str(path), why)
        raise LoRAError(f"LoRA adapter {request.lora_name!r} ({path}): not found, not readable, or not a PEFT LoRA "
                        "adapter (a directory of adapter_config.json and adapter_model.safetensors)")

    settings = _read_config(path, config, fail, not_an_adapter)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        fail("adapter_model.safetensors", "missing (only safetensors adapters are read)")
    try:
        header = read_header(file, _max_header_bytes(config))
    except (OSError, ValueError) as e:
        fail("adapter_model.safetensors", f"unreadable: {e.strerror if isinstance(e, OSError) else e}")
    plan = _plan(header, settings, config, max_lora_rank, fail)
    weights = _read_weights(file, header, plan, dtype, fail)
    return LoRAAdapter(request.lora_name, request.lora_int_id, max(a.shape[1] for a, _ in weights.values()),
                       weights)


def _plan(header: dict[str, TensorInfo], settings: "_Settings", config: ModelConfig, max_lora_rank: int,
          fail) -> dict[tuple[int, str], tuple[str, str, float]]:
    """From the header alone: (layer, target) -> (lora_A's key, lora_B's, the scaling), in layer and target order,
    once every tensor is a known LoRA weight of the right dtype and shape, of a rank this server takes."""
    shapes = target_shapes(config)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, info in header.items():
        m = _KEY.fullmatch(key)
        target = _CHECKPOINT_NAME.get(m["linear"]) if m else None
        if target is None:
            fail(key, "not a LoRA weight of a decoder layer's q/k/v/o/gate/up/down_proj (embeddings, the LM head, "
                      "DoRA magnitudes and biases are not supported)")
        layer = int(m["layer"])
        if layer >= config.num_layers:
            fail(key, f"layer {layer}, but the model has {config.num_layers}")
        if info.dtype not in _DTYPES:
            fail(key, f"dtype {info.dtype}; LoRA weights are {', '.join(_DTYPES)}")
        if len(info.shape) != 2:
            fail(key, f"a {len(info.shape)}-d array; LoRA weights are matrices")
        pairs.setdefault((layer, target), {})[m["which"]] = key
        modules[layer, target] = m["module"]
    plan = {}
    for (layer, target), pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        field = f"layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            fail(field, f"lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = header[pair["A"]].shape, header[pair["B"]].shape  # PEFT's [r, in] and [out, r]
        n_in, n_out = shapes[target]
        r = a[0]
        if a[1] != n_in or b[0] != n_out:
            fail(field, f"lora_A {a} and lora_B {b} do not fit the base layer's [{n_out}, {n_in}] "
                        "(an adapter for another model?)")
        if b[1] != r:
            fail(field, f"lora_A's rank {r} is not lora_B's {b[1]}")
        if not 1 <= r <= max_lora_rank:
            fail(field, f"rank {r} is above max_lora_rank {max_lora_rank}" if r else "rank 0 (empty weights)")
        want_r, alpha = settings.rank_and_alpha(modules[layer, target])
        if want_r != r:
            fail(field, f"rank {r} in the weights, {want_r} in adapter_config.json")
        plan[layer, target] = (pair["A"], pair["B"], alpha / (math.sqrt(r) if settings.use_rslora else r))
    if not plan:
        fail("adapter_model.safetensors", "holds no LoRA weights")
    return plan


def _read_weights(file: Path, header: dict[str, TensorInfo], plan, dtype, fail):
    """The planned tensors, A [in, r] and B [r, out] with the scaling folded in, in `dtype`."""
    import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16", without which a bf16 adapter is a TypeError
    from safetensors import SafetensorError, safe_open
    weights, bad = {}, None
    try:
        with safe_open(file, framework="numpy") as f:
            for (layer, target), (key_a, key_b, scaling) in plan.items():
                a, b = f.get_tensor(key_a), f.get_tensor(key_b)
                if (a.shape, b.shape) != (header[key_a].shape, header[key_b].shape):  # the file changed since
                    raise ValueError("its tensors are not those its header declared")
                a32, b32 = a.astype(np.float32), b.astype(np.float32)
                if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
                    bad = f"layer {layer} {target}"
                    break
                weights[layer, target] = (np.ascontiguousarray(a32.T, dtype=dtype),
                                          np.ascontiguousarray((b32 * np.float32(scaling)).T, dtype=dtype))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        fail("adapter_model.safetensors", f"unreadable: {e}")
    if bad is not None:  # (failed here: fail's LoRAError is a ValueError, which the handler above would rename)
        fail(bad, "holds non-finite values")
    return weights


@dataclasses.dataclass(frozen=True)
class _Settings:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: list  # compile_patterns' (pattern, value) pairs
    alpha_pattern: list

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """PEFT's per-module overrides: a pattern key matches a module whose name ends with it (at a dot)."""
        return (pattern_value(self.rank_pattern, module, self.r),
                pattern_value(self.alpha_pattern, module, self.lora_alpha))


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


def _read_config(path: Path, config: ModelConfig, fail, not_an_adapter) -> _Settings:
    file = path / "adapter_config.json"
    try:
        if not file.is_file():
            not_an_adapter(f"{file} is not a file")
        if file.stat().st_size > MAX_CONFIG_BYTES:
            not_an_adapter(f"{file} is {file.stat().st_size} bytes, above {MAX_CONFIG_BYTES}")
        c = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        not_an_adapter(f"{file} is unreadable: {e}")
    if not isinstance(c, dict):
        not_an_adapter(f"{file} is not a JSON object")
    if c.get("peft_type", "LORA") != "LORA":
        fail("peft_type", f"{_short(c['peft_type'])}; only LORA adapters are supported")
    for field, (default, what) in _UNSUPPORTED.items():
        value = c.get(field, default)
        if value != default and not (default is None and value in ([], {})):
            fail(field, f"{_short(value)} is not supported ({what})")
    r, alpha = c.get("r"), c.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        fail("r", f"must be a positive integer, got {_short(r)}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        fail("lora_alpha", f"must be a number, got {_short(alpha)}")
    patterns = {}
    # Each key is matched against each module: more keys than twice the model's modules (PEFT writes at most one
    # per module) only cost time.
    max_keys = 2 * config.num_layers * len(TARGETS) + 64
    for field in ("rank_pattern", "alpha_pattern"):
        value = c.get(field) or {}
        if not isinstance(value, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            fail(field, f"must map module patterns to numbers, got {_short(value)}")
        try:
            patterns[field] = compile_patterns(value, max_keys)
        except ValueError as e:
            fail(field, str(e))
    use_rslora = c.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        fail("use_rslora", f"must be true or false, got {_short(use_rslora)}")
    return _Settings(r, float(alpha), use_rslora, **patterns)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _max_header_bytes(config: ModelConfig) -> int:
    """A bound on the safetensors header of an adapter for this model: a few hundred bytes per tensor it can hold
    (lora_A and lora_B of each target of each layer), with room to spare."""
    return 64 * 1024 + 1024 * 2 * len(TARGETS) * config.num_layers
