"""Tiny random EAGLE-3 heads for a given target, written by hand in the public layouts (names as the EAGLE reference
and PyPI speculators write them, independent of jaxserve.weights.eagle3), for the loader's and the engine's tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.head_config import HeadConfig
from jaxserve.weights.eagle3 import LoadedHead

# The shared tiny Llama's config (tests/hf_models.py TINY, the `tiny_dir` fixture), without building it.
TINY_TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=128,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)

# Our module in the layer -> its name after `midlayer.` / `layers.0.` in both public layouts.
LAYER_NAMES = {"input_layernorm": "input_layernorm", "hidden_norm": "hidden_norm",
               "post_attention_layernorm": "post_attention_layernorm", "q_proj": "self_attn.q_proj",
               "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}


def tiny_feature_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and the final state: (2, L // 2, L - 3) does not fit a 2-layer target."""
    return tuple(sorted({0, num_layers // 2, num_layers}))


def random_head(target: ModelConfig, seed: int = 0, draft_vocab_size: int | None = None,
                feature_layers: tuple[int, ...] | None = None, embed_tokens: bool = True,
                norm_before_residual: bool = False, hidden_size: int | None = None,
                attention_bias: bool = False) -> LoadedHead:
    """A random head for `target` (its vocabulary; its hidden size unless given: the head then takes the target's
    embeddings), 4 heads of 16 over 2 KV heads; a reduced draft vocabulary (half the target's by default) mapped to
    a random sorted subset of target ids."""
    rng = np.random.default_rng(seed)
    V, Ht = target.vocab_size, target.hidden_size
    H, I, heads, kv, D = hidden_size or Ht, 96, 4, 2, 16
    Vd = draft_vocab_size or V // 2
    c = HeadConfig(kind="eagle3", hidden_size=H, intermediate_size=I, num_heads=heads, num_kv_heads=kv, head_dim=D,
                   vocab_size=V, draft_vocab_size=Vd, target_hidden_size=Ht,
                   feature_layers=feature_layers or tiny_feature_layers(target.num_layers),
                   rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=target.max_position_embeddings,
                   norm_before_residual=norm_before_residual, attention_bias=attention_bias)

    def w(*shape):  # kernels as the tree holds them: [in, out]
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    def norm():  # away from 1, so a misread or misplaced norm shows
        return {"weight": (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)}

    layer = {"input_layernorm": norm(), "hidden_norm": norm(), "post_attention_layernorm": norm(),
             "q_proj": {"kernel": w(2 * H, heads * D)}, "k_proj": {"kernel": w(2 * H, kv * D)},
             "v_proj": {"kernel": w(2 * H, kv * D)}, "o_proj": {"kernel": w(heads * D, H)},
             "gate_proj": {"kernel": w(H, I)}, "up_proj": {"kernel": w(H, I)}, "down_proj": {"kernel": w(I, H)}}
    if attention_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
            layer[name]["bias"] = w(layer[name]["kernel"].shape[1])
    params = {"fc": {"kernel": w(c.feature_size, H)}, "layers_0": layer, "norm": norm(),
              "lm_head": {"kernel": w(H, Vd)}}
    if embed_tokens:
        params["embed_tokens"] = w(V, H)
    target_ids = np.sort(rng.choice(V, Vd, replace=False))
    return LoadedHead(c, {"params": params}, (target_ids - np.arange(Vd)).astype(np.int32))


def checkpoint_tensors(head: LoadedHead, layout: str) -> dict[str, np.ndarray]:
    """The head's tensors by their names in `layout`, torch's layout (a linear's weight [out, in])."""
    prefix = {"eagle3": "midlayer.", "speculators": "layers.0."}[layout]
    p, c = head.params["params"], head.config
    tensors = {"fc.weight": p["fc"]["kernel"].T, "norm.weight": p["norm"]["weight"],
               "lm_head.weight": p["lm_head"]["kernel"].T}
    for ours, theirs in LAYER_NAMES.items():
        for leaf, value in p["layers_0"][ours].items():
            tensors[f"{prefix}{theirs}.{'bias' if leaf == 'bias' else 'weight'}"] = \
                value.T if leaf == "kernel" else value
    if "embed_tokens" in p:
        tensors["embed_tokens.weight"] = p["embed_tokens"]
    if layout == "eagle3" or c.draft_vocab_size != c.vocab_size:
        t2d = np.zeros(c.vocab_size, bool)
        t2d[np.arange(c.draft_vocab_size) + head.d2t] = True
        tensors.update(d2t=head.d2t.astype(np.int64), t2d=t2d)
    return {name: np.ascontiguousarray(v) for name, v in tensors.items()}


def checkpoint_config(head: LoadedHead, layout: str) -> dict:
    """config.json as the EAGLE reference (yuhuili's) or speculators (Eagle3SpeculatorConfig) writes it."""
    c = head.config
    layer = {"hidden_act": "silu", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
             "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
             "max_position_embeddings": c.max_position_embeddings,
             "vocab_size": c.vocab_size, "model_type": "llama", "tie_word_embeddings": False,
             "attention_bias": c.attention_bias, "mlp_bias": False, "torch_dtype": "float32"}
    if layout == "eagle3":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": c.draft_vocab_size,
                "target_hidden_size": c.target_hidden_size, "norm_before_residual": c.norm_before_residual,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)}}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
            "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "target_hidden_size": c.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}


def write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray], weights: str = "safetensors") -> str:
    """config.json and the tensors as model.safetensors or pytorch_model.bin (torch.save, as the reference does)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("*.safetensors")) + list(path.glob("*.bin")):
        old.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if weights == "bin":
        import torch
        torch.save({name: torch.from_numpy(np.array(v)) for name, v in tensors.items()}, path / "pytorch_model.bin")
    else:
        from safetensors.numpy import save_file
        save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def write_tiny_head(path, target: ModelConfig, layout: str = "speculators", seed: int = 0,
                    weights: str = "safetensors", **head_options) -> str:
    """A random head for `target` written in `layout` ("eagle3": the EAGLE reference's; "speculators") at `path`;
    returns the directory. The same seed and options give `random_head`'s params."""
    head = random_head(target, seed, **head_options)
    return write_checkpoint(path, checkpoint_config(head, layout), checkpoint_tensors(head, layout), weights)
