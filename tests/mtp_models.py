"""Tiny random MTP models: the shared tiny Llama's directory with a random multi-token-prediction layer added under
DeepSeek-V3's names (written by hand, independent of jaxserve.weights.mtp), for the loader's and the engine's tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# The tiny Llama's sizes (tests/hf_models.py TINY): hidden, FFN, heads, KV heads, head dim, vocabulary, layers.
H, I, HEADS, KV, D, V, LAYERS = 64, 128, 4, 2, 16, 320, 2


def random_mtp_tensors(seed: int, copies: bool = False, prefix: str = f"model.layers.{LAYERS}.") -> dict:
    """The MTP layer's tensors as a DeepSeek-style checkpoint writes them (linear weights [out, in]); copies: also
    its own embedding and LM head (random, so a head that used the target's instead would show)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    def norm():  # away from 1, so a misread or misplaced norm shows
        return (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)

    t = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": w(H, 2 * H),
         "shared_head.norm.weight": norm(), "input_layernorm.weight": norm(),
         "post_attention_layernorm.weight": norm(), "self_attn.q_proj.weight": w(HEADS * D, H),
         "self_attn.k_proj.weight": w(KV * D, H), "self_attn.v_proj.weight": w(KV * D, H),
         "self_attn.o_proj.weight": w(H, HEADS * D), "mlp.gate_proj.weight": w(I, H),
         "mlp.up_proj.weight": w(I, H), "mlp.down_proj.weight": w(H, I)}
    if copies:
        t.update({"embed_tokens.weight": w(V, H), "shared_head.head.weight": w(V, H)})
    return {prefix + name: value for name, value in t.items()}


def write_mtp_model(tiny_dir, path, seed: int = 0, copies: bool = False, extra: dict | None = None) -> str:
    """A copy of the tiny Llama at `path` with an MTP layer: its tensors in a second safetensors file, and
    config.json's num_nextn_predict_layers 1, as DeepSeek-V3's checkpoint has them."""
    from safetensors.numpy import save_file
    path = Path(path)
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    tensors = {**random_mtp_tensors(seed, copies), **(extra or {})}
    save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return str(path)
