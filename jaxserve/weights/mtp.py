"""MTP heads from the target's own checkpoint (DeepSeek-V3's naming), read into `jaxserve.model.mtp.MtpHead`'s
params.

A model trained with multi-token prediction ships its MTP layer beside its decoder layers: config.json's
`num_nextn_predict_layers` counts them, and the first is numbered after the last decoder layer, its tensors under
`model.layers.{num_hidden_layers}.` (DeepSeek-V3, GLM-4.5; what vLLM's `deepseek_mtp` reads): `enorm`, `hnorm`,
`eh_proj` [hidden, 2 x hidden], a decoder layer's tensors under the target's own names, `shared_head.norm` and,
optionally, copies of the target's `embed_tokens` and LM head (`shared_head.head`; absent: the target's are used,
the same arrays). The layer must be the target's kind of layer, which here is a dense Llama-style one (DeepSeek's
MLA and MoE layers are not served). Qwen3-Next's `mtp.*` naming (a `fc`, its own norms) is not read.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.families import LINEARS, family_of
from jaxserve.model.head_config import HeadConfig
from jaxserve.weights.eagle3 import LoadedHead, tree_of

# What the MTP layer computes only as the target's dense Llama-style layer: (field, the value it computes).
PLAIN_LAYER = (("qk_norm", False), ("sandwich_norm", False), ("hidden_activation", "silu"),
               ("embedding_multiplier", 1.0), ("sliding_window", None), ("layer_types", None))
# Tensors an MTP layer may carry that the head does not use (RoPE's frequencies: computed from rope_theta).
UNUSED = ("rotary_emb.inv_freq",)


def mtp_prefix(target: ModelConfig) -> str:
    """The first MTP layer's tensors' prefix: numbered after the target's last decoder layer."""
    return f"model.layers.{target.num_layers}."


def load_mtp_head(path, target: ModelConfig, dtype=np.float32) -> LoadedHead:
    """The MTP head in the target's checkpoint directory `path`, refused with the reason named where the
    directory has none (no tensors under the MTP prefix), more than one, or one the head does not compute."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"speculative method 'mtp' reads the MTP layer from the target's HF checkpoint directory "
                         f"(config.json and *.safetensors); {path} is not one")
    raw = json.loads((path / "config.json").read_text())
    layers = raw.get("num_nextn_predict_layers") if isinstance(raw, dict) else None
    prefix = mtp_prefix(target)
    tensors = read_prefixed(path, prefix)
    if not tensors:
        raise ValueError(f"{path} has no MTP layer: no tensors under {prefix!r} (DeepSeek-V3's naming; "
                         f"config.json num_nextn_predict_layers: {layers}); speculative method 'mtp' needs a "
                         f"checkpoint that ships its multi-token-prediction layer")
    if layers is not None and layers != 1:
        raise ValueError(f"{path}: config.json num_nextn_predict_layers is {layers!r}; only one MTP layer is served")
    try:
        config = mtp_head_config(target)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return LoadedHead(config, {"params": params_from_tensors(tensors, config, target, dtype, path)},
                      np.zeros(config.draft_vocab_size, np.int32))


def mtp_head_config(target: ModelConfig) -> HeadConfig:
    """The head of `target`: its layer is one of the target's (its sizes and RoPE), over the full vocabulary,
    reading the target's final state."""
    for field, value in PLAIN_LAYER:
        if getattr(target, field) != value:
            raise ValueError(f"the target's {field} is {getattr(target, field)!r}; an MTP head's layer is served "
                             f"only as a dense Llama-style layer ({field} = {value!r})")
    t = target
    return HeadConfig(kind="mtp", hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                      vocab_size=t.vocab_size, draft_vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
                      feature_layers=(t.num_layers,), rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
                      rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings,
                      attention_bias=t.attention_bias)


def read_prefixed(path: Path, prefix: str) -> dict[str, np.ndarray]:
    """The tensors named under `prefix` in a directory's *.safetensors, by name without it: only those are read,
    not the whole model."""
    from safetensors import SafetensorError, safe_open
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="numpy") as file:
                for name in file.keys():
                    if name.startswith(prefix):
                        tensors[name[len(prefix):]] = file.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {f}: {e}") from None
    return tensors


def expected_tensors(c: HeadConfig, target: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The MTP layer's tensors, named after the prefix: name -> (where in the params tree, shape as written: a
    linear's weight [out, in], which the tree holds as a kernel [in, out]). Without the optional copies of the
    target's embedding and LM head."""
    H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    names: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
        "enorm.weight": (("enorm", "weight"), (H,)), "hnorm.weight": (("hnorm", "weight"), (H,)),
        "eh_proj.weight": (("eh_proj", "kernel"), (H, 2 * H)),
        "shared_head.norm.weight": (("shared_head_norm", "weight"), (H,))}
    for ours, theirs in family_of(target).norms.items():
        names[f"{theirs}.weight"] = (("layers_0", ours, "weight"), (H,))
    shapes = {"q_proj": (c.num_heads * D, H), "k_proj": (c.num_kv_heads * D, H), "v_proj": (c.num_kv_heads * D, H),
              "o_proj": (H, c.num_heads * D), "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    for ours, theirs in LINEARS.items():
        names[f"{theirs}.weight"] = (("layers_0", ours, "kernel"), shapes[ours])
        if c.attention_bias and ours in ("q_proj", "k_proj", "v_proj"):
            names[f"{theirs}.bias"] = (("layers_0", ours, "bias"), shapes[ours][:1])
    return names


def params_from_tensors(tensors: dict, c: HeadConfig, target: ModelConfig, dtype, path: Path) -> dict:
    """The head's params tree; every tensor checked for its name and shape first, so a layer of another shape
    (e.g. DeepSeek's MoE experts) is refused naming the tensor, not in a compile."""
    expected = expected_tensors(c, target)
    optional = {"embed_tokens.weight": (("embed_tokens",), (c.vocab_size, c.hidden_size)),
                "shared_head.head.weight": (("lm_head", "kernel"), (c.vocab_size, c.hidden_size))}
    expected.update({name: where for name, where in optional.items() if name in tensors})
    where_ = f"{path} (under {mtp_prefix(target)!r})"
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"{where_}: the MTP layer is missing tensors {missing}")
    extra = sorted(n for n in tensors.keys() - expected.keys() if not n.endswith(UNUSED))
    if extra:
        raise ValueError(f"{where_}: the MTP layer has tensors a dense Llama-style layer does not use: {extra[:8]}")
    return tree_of(tensors, expected, dtype, where_)
