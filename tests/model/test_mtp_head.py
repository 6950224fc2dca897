"""The MTP module against DeepSeek-V3's MTP as vLLM computes it, written out in numpy for one token: the target's
normed final state and the token's embedding, each normed (enorm, hnorm), side by side as [embedding, hidden],
eh_proj, one Llama layer, shared_head.norm, the LM head; the embedding zeroed at position 0."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import RaggedRows
from jaxserve.cache import init_kv_cache
from jaxserve.config import ModelConfig
from jaxserve.model.heads import declared_head_params, head_module
from jaxserve.weights.mtp import mtp_head_config

TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)


def rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def one_token(position):
    return RaggedRows(positions=jnp.array([position], jnp.int32), token_row=jnp.zeros(1, jnp.int32),
                      query_start=jnp.array([0, 1], jnp.int32), cached_lens=jnp.zeros(1, jnp.int32),
                      page_table=jnp.array([[1]], jnp.int32))


def test_one_token_is_deepseeks_mtp():
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    c = mtp_head_config(TARGET)
    shapes = declared_head_params(c).shapes
    params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape) + (1 if len(s.shape) == 1 else 0))
                          .astype(np.float32), shapes)
    p, lp = params["params"], params["params"]["layers_0"]
    token, state = 7, rng.standard_normal(c.hidden_size).astype(np.float32)  # the target's pre-norm final state
    model, cache = head_module(c), init_kv_cache(c.layer_config(), 2, 4, jnp.float32)
    for position in (5, 0):
        logits, out, _ = model.apply(params, jnp.array([token]), jnp.asarray(state[None]),
                                     jnp.zeros((1, c.hidden_size)), jnp.ones(1, bool), cache, one_token(position))
        e = np.asarray(p["embed_tokens"])[token] * (position != 0)
        h = rms(state, p["norm"]["weight"])
        x = np.concatenate([rms(e, p["enorm"]["weight"]), rms(h, p["hnorm"]["weight"])]) @ p["eh_proj"]["kernel"]
        a = rms(x, lp["input_layernorm"]["weight"])
        v = (a @ lp["v_proj"]["kernel"]).reshape(c.num_kv_heads, c.head_dim)  # one token attends to itself: v
        attn = np.repeat(v, c.num_heads // c.num_kv_heads, axis=0).reshape(-1)
        x = x + attn @ lp["o_proj"]["kernel"]
        m = rms(x, lp["post_attention_layernorm"]["weight"])
        gate = m @ lp["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (m @ lp["up_proj"]["kernel"])) @ lp["down_proj"]["kernel"]
        want = rms(x, p["shared_head_norm"]["weight"]) @ p["lm_head"]["kernel"]
        np.testing.assert_allclose(np.asarray(out[0]), x, rtol=2e-4, atol=2e-4, err_msg=f"seed {seed}")
        np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=2e-4, atol=2e-4,
                                   err_msg=f"seed {seed}, position {position}")
