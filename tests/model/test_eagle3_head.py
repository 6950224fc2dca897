"""The EAGLE-3 head's forward against a numpy reference of the published architecture (vLLM's llama_eagle3 / the
EAGLE-3 reference): fc over the concatenated features, input_layernorm(embedding) and hidden_norm(hidden) side by
side into q/k/v, the hidden state (or, with norm_before_residual, its norm) as the residual, a SwiGLU MLP, the
final norm and the draft LM head; Llama's RoPE (rotate-half), grouped-query causal attention."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import RaggedRows
from jaxserve.cache import init_kv_cache
from jaxserve.model.eagle3 import Eagle3Head, to_target_vocab

from eagle3_heads import TINY_TARGET, random_head


def rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, positions, theta):  # x [T, heads, D], HF Llama's rotate_half convention
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    angles = positions[:, None] * inv[None]  # [T, D/2]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    half = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


def reference(head, embed, tokens, features, hidden, from_target):
    c, p = head.config, head.params["params"]
    lay = p["layers_0"]
    e = embed[tokens]
    h = np.where(from_target[:, None], features @ p["fc"]["kernel"], hidden)
    en, hn = rms(e, lay["input_layernorm"]["weight"]), rms(h, lay["hidden_norm"]["weight"])
    residual = hn if c.norm_before_residual else h
    x = np.concatenate([en, hn], -1)
    T, D = len(tokens), c.head_dim
    q = (x @ lay["q_proj"]["kernel"]).reshape(T, c.num_heads, D)
    k = (x @ lay["k_proj"]["kernel"]).reshape(T, c.num_kv_heads, D)
    v = (x @ lay["v_proj"]["kernel"]).reshape(T, c.num_kv_heads, D)
    pos = np.arange(T, dtype=np.float64)
    q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
    group = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
    w = np.exp(s - s.max(-1, keepdims=True))
    attn = np.einsum("hts,shd->thd", w / w.sum(-1, keepdims=True), v).reshape(T, -1)
    x = residual + attn @ lay["o_proj"]["kernel"]
    m = rms(x, lay["post_attention_layernorm"]["weight"])
    g = m @ lay["gate_proj"]["kernel"]
    out = x + (g / (1 + np.exp(-g)) * (m @ lay["up_proj"]["kernel"])) @ lay["down_proj"]["kernel"]
    return rms(out, p["norm"]["weight"]) @ p["lm_head"]["kernel"], out


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_head_is_the_published_architecture(norm_before_residual):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    head = random_head(TINY_TARGET, seed, norm_before_residual=norm_before_residual, hidden_size=48)
    c, T = head.config, 11
    tokens = rng.integers(0, c.vocab_size, T)
    features = rng.standard_normal((T, c.feature_size)).astype(np.float32)
    hidden = rng.standard_normal((T, c.hidden_size)).astype(np.float32)
    from_target = rng.random(T) < 0.6  # a chained token takes `hidden`, whatever its features
    want_logits, want_out = reference(head, head.params["params"]["embed_tokens"].astype(np.float64), tokens,
                                      features.astype(np.float64), hidden.astype(np.float64), from_target)
    pages = -(-T // 4)
    rows = RaggedRows(positions=jnp.arange(T, dtype=jnp.int32), token_row=jnp.zeros(T, jnp.int32),
                      query_start=jnp.array([0, T], jnp.int32), cached_lens=jnp.zeros(1, jnp.int32),
                      page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None])
    cache = init_kv_cache(c.layer_config(), pages + 1, 4, jnp.float32)
    for backend in ("reference", "dense"):
        logits, out, _ = Eagle3Head(c, attention_backend=backend).apply(
            head.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(features), jnp.asarray(hidden),
            jnp.asarray(from_target), cache, rows)
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-4, atol=2e-4, err_msg=f"{backend}, seed {seed}")
        np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=2e-4, atol=2e-4,
                                   err_msg=f"{backend}, seed {seed}")


def test_draft_ids_map_to_target_ids():
    d2t = np.array([0, 2, 2, 5])  # draft ids 0..3 -> target ids 0, 3, 4, 8
    logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0]])
    full = np.asarray(to_target_vocab(logits, jnp.asarray(d2t), 10))
    assert full[0, [0, 3, 4, 8]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert np.isneginf(np.delete(full[0], [0, 3, 4, 8])).all()
