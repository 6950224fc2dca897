"""HF-named tensors -> the model's params pytree (the one conversion every loader shares)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig

_LINEARS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


def params_from_hf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """tensors: HF names, HF layout (linear weights are [out, in]). Returns {"params": ...} for LlamaModel.apply."""
    def take(name):
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return jnp.asarray(np.asarray(tensors[name], dtype=np.float32), dtype=dtype)

    params = {"embed_tokens": take("model.embed_tokens.weight"), "norm": {"weight": take("model.norm.weight")}}
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    params["lm_head"] = {"kernel": take(head).T}  # [hidden, vocab]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        layer = {
            "input_layernorm": {"weight": take(prefix + "input_layernorm.weight")},
            "post_attention_layernorm": {"weight": take(prefix + "post_attention_layernorm.weight")},
        }
        for ours, theirs in _LINEARS.items():
            layer[ours] = {"kernel": take(prefix + theirs + ".weight").T}  # [in, out] so the model computes x @ W
            if config.attention_bias and ours in ("q_proj", "k_proj", "v_proj"):
                layer[ours]["bias"] = take(prefix + theirs + ".bias")
        params[f"layers_{i}"] = layer
    return {"params": params}


def param_bytes(params) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
