"""A tiny random Llama stretched to 128K tokens by YaRN (written with numpy: no torch), and a streaming numpy
reference of it whose memory stays flat in the length: queries in blocks, no [T, T] array."""
from __future__ import annotations

import json

import numpy as np

from jaxserve.model.rope import rope_parameters

# One layer: a reference of more would attend from every position in every layer but the last (L^2 work, minutes at
# 128K in numpy), one attends from the probes alone. 1 KV head of 16 dims for 2 query heads: grouped queries, and a
# head_dim that YaRN splits in bands.
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=32,
              intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))
LONG_CONTEXT = 4 * 32768  # the derived max_model_len: 131072


def random_weights(seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights [out, in], scaled so activations stay O(1) through the layers."""
    rng = np.random.default_rng(seed)
    c = CONFIG
    E, F, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, KVH = c["num_attention_heads"], c["num_key_value_heads"]

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm():
        return (1 + 0.2 * rng.standard_normal(E)).astype(np.float32)
    out = {"model.embed_tokens.weight": rng.standard_normal((c["vocab_size"], E)).astype(np.float32),
           "model.norm.weight": norm(), "lm_head.weight": w(c["vocab_size"], E)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                # a larger query scale: attention that is not near-uniform over 100K keys
                p + "self_attn.q_proj.weight": 3 * w(H * D, E), p + "self_attn.k_proj.weight": 3 * w(KVH * D, E),
                p + "self_attn.v_proj.weight": w(KVH * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
                p + "mlp.gate_proj.weight": w(F, E), p + "mlp.up_proj.weight": w(F, E),
                p + "mlp.down_proj.weight": w(E, F)}
    return out


def save_long_model(path, seed: int = 0) -> dict[str, np.ndarray]:
    from safetensors.numpy import save_file
    weights = random_weights(seed)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return weights


def _rms(x, g, eps=CONFIG["rms_norm_eps"]):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _rope(x, positions, inv_freq, factor):
    """x [n, heads, D] float64, rotate-half; the angles rounded to float32 as the engine's (at position 1e5 a float64
    angle differs from the float32 one by ~1e-2 rad in the fastest band)."""
    angles = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)  # [n, D / 2]
    cos, sin = np.cos(angles)[:, None] * factor, np.sin(angles)[:, None] * factor
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class StreamingReference:
    """The model in numpy (float64; the attention's dots float32) over one sequence, layer by layer: a layer's keys
    and values for every position (the next layer needs its input everywhere), attention by blocks of `block`
    queries against the keys up to the block's end. `logits(token_ids, probes)` gives the logits at the probe
    positions only: the last layer attends from those alone."""

    def __init__(self, weights: dict[str, np.ndarray], block: int = 128):
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        c = CONFIG
        self.inv_freq, self.factor = rope_parameters(c["head_dim"], c["rope_theta"], c["rope_scaling"],
                                                     c["max_position_embeddings"])
        self.block = block

    def _attend(self, i, x, probes):
        """Layer i's attention output at positions `probes` [n] for the normed input x [L, E]."""
        p, c = f"model.layers.{i}.self_attn.", CONFIG
        H, KVH, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        L = len(x)
        pos = np.arange(L)
        k = _rope((x @ self.w[p + "k_proj.weight"].T).reshape(L, KVH, D), pos, self.inv_freq, self.factor)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(L, KVH, D)
        q = _rope((x[probes] @ self.w[p + "q_proj.weight"].T).reshape(len(probes), H, D), probes, self.inv_freq,
                  self.factor)
        G = H // KVH
        q = (q / np.sqrt(D)).reshape(len(probes), KVH, G, D).astype(np.float32)
        k, v = k.astype(np.float32), v.astype(np.float32)
        out = np.empty(q.shape, np.float64)  # [n, KVH, G, D]
        for lo in range(0, len(probes), self.block):
            qb, pb = q[lo:lo + self.block], probes[lo:lo + self.block]
            end = pb.max() + 1
            hidden = np.arange(end)[None, :] > pb[:, None]  # [b, end]: keys after the query
            for h in range(KVH):  # float32 BLAS dots: the [b * G, end] scores are the reference's whole cost
                s = (qb[:, h].reshape(-1, D) @ k[:end, h].T).reshape(len(pb), G, end)
                s[np.broadcast_to(hidden[:, None, :], s.shape)] = -np.inf
                e = np.exp(s - s.max(-1, keepdims=True))
                out[lo:lo + self.block, h] = (e.reshape(-1, end) @ v[:end, h]).reshape(len(pb), G, D) \
                    / e.sum(-1, keepdims=True)
        return out.reshape(len(probes), H * D) @ self.w[p + "o_proj.weight"].T

    def logits(self, token_ids, probes) -> np.ndarray:
        """float64 logits [len(probes), V] after the tokens up to and including each probe position."""
        probes = np.asarray(probes)
        h = self.w["model.embed_tokens.weight"][np.asarray(token_ids)]  # [L, E]
        layers = CONFIG["num_hidden_layers"]
        for i in range(layers):
            p = f"model.layers.{i}."
            at = np.arange(len(h)) if i < layers - 1 else probes
            h = h[at] + self._attend(i, _rms(h, self.w[p + "input_layernorm.weight"]), at)
            x = _rms(h, self.w[p + "post_attention_layernorm.weight"])
            gate = x @ self.w[p + "mlp.gate_proj.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * (x @ self.w[p + "mlp.up_proj.weight"].T)) @ \
                self.w[p + "mlp.down_proj.weight"].T
        return _rms(h, self.w["model.norm.weight"]) @ self.w["lm_head.weight"].T
