"""HF-named tensors -> the model's params pytree (the one conversion every loader shares)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.families import LINEARS, family_of


def params_from_hf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], dtype) -> dict:
    """tensors: HF names, HF layout (linear weights are [out, in]). Returns {"params": ...} for the family's model
    (jaxserve.model.families: its norms' names and convention)."""
    family = family_of(config)

    def take(name, offset=0.0):
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return jnp.asarray(np.asarray(tensors[name], dtype=np.float32) + offset, dtype=dtype)

    def norm(name):
        return {"weight": take(name, family.norm_offset)}

    params = {"embed_tokens": take("model.embed_tokens.weight"), "norm": norm("model.norm.weight")}
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    params["lm_head"] = {"kernel": take(head).T}  # [hidden, vocab]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        layer = {ours: norm(prefix + theirs + ".weight") for ours, theirs in family.norms.items()}
        for ours, theirs in LINEARS.items():
            layer[ours] = {"kernel": take(prefix + theirs + ".weight").T}  # [in, out] so the model computes x @ W
            if config.attention_bias and ours in ("q_proj", "k_proj", "v_proj"):
                layer[ours]["bias"] = take(prefix + theirs + ".bias")
        params[f"layers_{i}"] = layer
    return {"params": params}


def param_bytes(params) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
