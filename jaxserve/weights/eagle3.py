"""EAGLE-3 heads in the public checkpoint layouts, read into the params of `jaxserve.model.eagle3.Eagle3Head`.

Two layouts are in use, both a directory with config.json and weights:
- "eagle3", the EAGLE authors' (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a Llama config (architectures
  LlamaForCausalLMEagle3, `draft_vocab_size`, maybe `target_hidden_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`), the layer's tensors under `midlayer.`, in pytorch_model.bin or
  model.safetensors.
- "speculators", PyPI `speculators`' (what vLLM loads with no flags): `speculators_model_type: "eagle3"`, the layer's
  Llama config nested as `transformer_layer_config`, the head's fields beside it, the layer's tensors under
  `layers.0.`, in model.safetensors.
Both keep `fc`, `norm`, `lm_head` (draft vocabulary rows), maybe `embed_tokens` (absent: the target's is used), and,
when the draft vocabulary is reduced, `d2t` (draft id i is target id i + d2t[i]) and `t2d` (a target id's mask).
Defaults follow vLLM's reading where a field is absent: the target's vocabulary as the draft's, the head's hidden
size as the target's, the layers (2, L // 2, L - 3), norm_before_residual False ("eagle3") or True ("speculators").
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.head_config import HeadConfig, default_feature_layers
from jaxserve.weights.hf_dir import read_safetensors

LAYOUTS = ("eagle3", "speculators")
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
# Tensors a checkpoint may carry that the head does not use: the vocabulary mask (d2t says the same), RoPE's
# frequencies (computed from rope_theta) and the verifier's copies that speculators keeps for training.
UNUSED = ("t2d", "verifier_lm_head.weight", "verifier_norm.weight", "rotary_emb.inv_freq")
# What a public head may switch on that this head does not compute: (field, the value it computes).
UNSUPPORTED = (("num_hidden_layers", 1), ("hidden_act", "silu"), ("mlp_bias", False), ("norm_before_fc", False),
               ("fc_norm", False), ("norm_output", False))


@dataclasses.dataclass
class LoadedHead:
    config: HeadConfig
    params: dict  # {"params": ...}: Eagle3Head's tree as numpy arrays (embed_tokens only if the checkpoint has it)
    d2t: np.ndarray  # int32 [draft_vocab_size]: target id = draft id + d2t[draft id]


def load_head(path, target_config: ModelConfig, dtype=np.float32) -> LoadedHead:
    """The EAGLE-3 head in directory `path` (either public layout), checked against the target it will read:
    a head trained on another model reads hidden states of the wrong size or meaning, so it is refused here, with
    the field that disagrees, rather than proposing nothing useful."""
    path = Path(path)
    raw = read_config(path)
    tensors = read_weights(path)
    layout = layout_of(raw, tensors, path)
    try:
        config = head_config(raw, layout, target_config)
        config.check_target(target_config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    params = params_from_tensors(tensors, config, layout, dtype, path)
    return LoadedHead(config, {"params": params}, draft_to_target(tensors, config, path))


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json, so it is not a speculative head's directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} holds no JSON object")
    return raw


def layout_of(raw: dict, tensors: dict, path: Path) -> str:
    """Which public layout a head is in, from what each layout alone writes: some EAGLE heads name their
    architecture only LlamaForCausalLM, and their `midlayer.` tensors tell."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ValueError(f"{path}: speculators_model_type {kind!r} is not supported; only 'eagle3' heads load")
        return "speculators"
    if any("eagle3" in str(a).lower() for a in raw.get("architectures") or ()) or \
            any(name.startswith(LAYER_PREFIX["eagle3"]) for name in tensors):
        return "eagle3"
    raise ValueError(f"{path}: the head is in no EAGLE-3 layout this loads: neither `speculators_model_type: "
                     f"\"eagle3\"` (speculators) nor an Eagle3 architecture such as LlamaForCausalLMEagle3 or "
                     f"`midlayer.` tensors (the EAGLE reference); architectures: {raw.get('architectures')}")


def head_config(raw: dict, layout: str, target: ModelConfig) -> HeadConfig:
    """A config.json's head. Its layer is a one-layer Llama, read as the target's configs are (RoPE included)."""
    if layout == "speculators":
        layer, where = raw.get("transformer_layer_config"), "transformer_layer_config."
        if not isinstance(layer, dict):
            raise ValueError("config.json has no transformer_layer_config object (the head's layer)")
        top, aux = raw, raw.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = raw.get("norm_before_residual", True)
    else:
        layer, where, top = raw, "", raw
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("eagle_config.use_aux_hidden_state is false: a head without the target's layer "
                             "features (EAGLE-1 style) is not supported")
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = raw.get("norm_before_residual", False)
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}model_type is {layer['model_type']!r}; only Llama-style head layers load")
    for field, value in UNSUPPORTED:
        source = top if field in top and field not in layer else layer
        if source.get(field, value) != value:
            prefix = where if source is layer else ""
            raise ValueError(f"{prefix}{field} is {source[field]!r}; this head computes only {field} = {value!r}")
    try:
        m = ModelConfig.from_hf_config({**layer, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    except KeyError as e:
        raise ValueError(f"config.json is missing the field {where}{e.args[0]}") from None
    if aux is not None and (not isinstance(aux, list) or len(set(aux)) != len(aux) or not aux):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must list distinct target layers, got {aux!r}")
    vocab = m.vocab_size
    return HeadConfig(
        kind="eagle3", hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=vocab,
        draft_vocab_size=top.get("draft_vocab_size") or vocab,
        target_hidden_size=top.get("target_hidden_size") or m.hidden_size,
        # Sorted: vLLM concatenates the layers' states in layer order, whatever order the config lists them in.
        feature_layers=tuple(sorted(aux)) if aux else default_feature_layers(target.num_layers),
        rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, rope_scaling=m.rope_scaling,
        max_position_embeddings=m.max_position_embeddings, attention_bias=m.attention_bias,
        norm_before_residual=bool(norm_before_residual))


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """A head's tensors from model.safetensors (numpy) or else pytorch_model.bin (through torch, if installed)."""
    if any(path.glob("*.safetensors")):
        return read_safetensors(path)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{path} holds no weights: neither *.safetensors nor pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise ValueError(f"{bins[0]} is a torch pickle, and reading it needs torch (pip install torch), or "
                         f"convert it to model.safetensors") from None
    tensors = {}
    for f in bins:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many kinds for a damaged or unsafe pickle
            raise ValueError(f"cannot read weights file {f}: {e}") from None
        for name, t in state.items():  # bf16 has no numpy dtype: float tensors cross as float32
            tensors[name] = (t.float() if t.is_floating_point() else t).numpy()
    return tensors


def expected_tensors(c: HeadConfig, layout: str) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """A head's tensors in `layout`: name -> (where in the params tree, shape as written: torch's, a linear's
    weight [out, in], which the tree holds transposed as a kernel [in, out]). Without the optional embed_tokens."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    layer = LAYER_PREFIX[layout]
    names: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
        "fc.weight": (("fc", "kernel"), (H, c.feature_size)), "norm.weight": (("norm", "weight"), (H,)),
        "lm_head.weight": (("lm_head", "kernel"), (c.draft_vocab_size, H))}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[f"{layer}{norm}.weight"] = (("layers_0", norm, "weight"), (H,))
    linears = {"self_attn.q_proj": (c.num_heads * D, 2 * H), "self_attn.k_proj": (c.num_kv_heads * D, 2 * H),
               "self_attn.v_proj": (c.num_kv_heads * D, 2 * H), "self_attn.o_proj": (H, c.num_heads * D),
               "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
    for name, shape in linears.items():
        ours = name.split(".")[1]
        names[f"{layer}{name}.weight"] = (("layers_0", ours, "kernel"), shape)
        if c.attention_bias and ours in ("q_proj", "k_proj", "v_proj"):
            names[f"{layer}{name}.bias"] = (("layers_0", ours, "bias"), shape[:1])
    return names


def params_from_tensors(tensors: dict, c: HeadConfig, layout: str, dtype, path: Path) -> dict:
    """The head's params tree from its checkpoint's tensors; every tensor is checked for its name and shape first,
    so a head for another configuration fails here, naming the tensor, not in a compile."""
    expected = expected_tensors(c, layout)
    if "embed_tokens.weight" in tensors:
        expected["embed_tokens.weight"] = (("embed_tokens",), (c.vocab_size, c.hidden_size))
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"{path}: the head's checkpoint is missing tensors {missing} ({layout} layout)")
    extra = sorted(n for n in tensors.keys() - expected.keys() - {"d2t"} if not n.endswith(UNUSED))
    if extra:
        raise ValueError(f"{path}: the head's checkpoint has tensors this head does not use: {extra} ({layout} "
                         f"layout; its config: attention_bias {c.attention_bias})")
    return tree_of(tensors, expected, dtype, str(path), lambda name: fc_note(c) if name == "fc.weight" else "")


def tree_of(tensors: dict, expected: dict, dtype, where: str, note=lambda name: "") -> dict:
    """The params tree of the tensors `expected` names ({name: (path in the tree, shape)}), each shape checked
    (a mismatch raises naming the tensor at `where`, with note(name) after)."""
    params: dict = {}
    for name, (leaf, shape) in expected.items():
        value = np.asarray(tensors[name])
        if value.shape != shape:
            raise ValueError(f"{where}: tensor {name} has shape {list(value.shape)}, the config gives {list(shape)}"
                             f"{note(name)}")
        put_leaf(params, leaf, value, dtype)
    return params


def put_leaf(tree: dict, where: tuple[str, ...], value, dtype) -> None:
    """A checkpoint's tensor at path `where` of a params tree: a linear's weight, written [out, in], as the
    kernel [in, out] the model multiplies by."""
    node = tree
    for key in where[:-1]:
        node = node.setdefault(key, {})
    value = np.asarray(value).astype(np.float32)
    node[where[-1]] = (value.T if where[-1] == "kernel" else value).astype(dtype)


def fc_note(c: HeadConfig) -> str:
    return (f" (fc reads {len(c.feature_layers)} target layers {list(c.feature_layers)} x target_hidden_size "
            f"{c.target_hidden_size} = {c.feature_size} floats per token)")


def draft_to_target(tensors: dict, c: HeadConfig, path: Path) -> np.ndarray:
    """d2t as int32 offsets [Vd], checked: each draft id must land on a distinct target id, or the head would
    propose tokens the target cannot have (or two draft rows would fight over one target logit)."""
    if "d2t" not in tensors:
        if c.draft_vocab_size != c.vocab_size:
            raise ValueError(f"{path}: the head's checkpoint is missing tensor d2t, the draft vocabulary's map "
                             f"(draft_vocab_size {c.draft_vocab_size} < vocab_size {c.vocab_size})")
        return np.zeros(c.draft_vocab_size, np.int32)
    d2t = np.asarray(tensors["d2t"])
    if d2t.shape != (c.draft_vocab_size,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"{path}: tensor d2t is {d2t.dtype} {list(d2t.shape)}, not integers [draft_vocab_size "
                         f"{c.draft_vocab_size}]")
    ids = np.arange(c.draft_vocab_size) + d2t.astype(np.int64)
    outside = np.flatnonzero((ids < 0) | (ids >= c.vocab_size))
    if len(outside):
        raise ValueError(f"{path}: tensor d2t maps draft ids {outside[:4].tolist()} to target ids "
                         f"{ids[outside[:4]].tolist()}, outside the target's vocabulary [0, {c.vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{path}: tensor d2t maps two draft ids to one target id")
    t2d = tensors.get("t2d")
    if t2d is not None and (np.shape(t2d) != (c.vocab_size,) or not np.asarray(t2d, bool)[ids].all()):
        raise ValueError(f"{path}: tensors t2d and d2t disagree (t2d must be a mask [vocab_size {c.vocab_size}] "
                         f"true at every target id d2t maps to)")
    return d2t.astype(np.int32)


def save_head(path, loaded: LoadedHead, layout: str = "speculators", target_name: str = "",
              target_architectures: tuple[str, ...] = (), speculative_tokens: int = 3) -> Path:
    """Writes a head in a public layout (model.safetensors and config.json), as `load_head`, vLLM and speculators
    read it: a head trained here serves elsewhere too. target_name: the target's HF id or path (speculators'
    verifier); speculative_tokens: the chain length speculators records (vLLM's default num_speculative_tokens)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}; known: {LAYOUTS}")
    from safetensors.numpy import save_file
    c, params = loaded.config, loaded.params["params"]
    tensors = {}
    names = expected_tensors(c, layout)
    if "embed_tokens" in params:
        names["embed_tokens.weight"] = (("embed_tokens",), (c.vocab_size, c.hidden_size))
    for name, (where, _) in names.items():
        value = params
        for key in where:
            value = value[key]
        value = np.asarray(value)
        tensors[name] = np.ascontiguousarray(value.T if where[-1] == "kernel" else value)
    # speculators keeps the maps only for a reduced vocabulary; the reference layout always has them.
    if layout == "eagle3" or c.draft_vocab_size != c.vocab_size:
        d2t = np.asarray(loaded.d2t, np.int64)  # torch.long, as both write it
        t2d = np.zeros(c.vocab_size, bool)
        t2d[np.arange(c.draft_vocab_size) + d2t] = True
        tensors.update(d2t=d2t, t2d=t2d)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = (speculators_json(c, target_name, list(target_architectures), speculative_tokens) if layout == "speculators"
           else {**layer_json(c), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
                 "target_hidden_size": c.target_hidden_size, "norm_before_residual": c.norm_before_residual,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
                                  "use_aux_hidden_state": True}})
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def layer_json(c: HeadConfig) -> dict:
    """The head's layer as a HF Llama config (what both layouts write for it)."""
    return {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias,
            "mlp_bias": False, "tie_word_embeddings": False}


def speculators_json(c: HeadConfig, target_name: str, target_architectures: list, speculative_tokens: int) -> dict:
    """speculators' Eagle3SpeculatorConfig as it serializes: the head's fields, the layer nested, and the proposal
    (a greedy chain) and verifier that vLLM reads num_speculative_tokens and the target from."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer_json(c), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_name or None, "architectures": target_architectures}}}
