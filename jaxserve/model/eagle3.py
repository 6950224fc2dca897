"""The EAGLE-3 head: one decoder layer over the token's embedding and the target's hidden states, proposing tokens.

EAGLE-3 (Li et al. 2025) reads three of the target's hidden states (a low, a middle and a high layer: their inputs,
`HeadConfig.feature_layers`) and projects them with `fc` to one hidden state. Its layer attends over its own K/V
pages, with the token's embedding (input_layernorm) and that hidden state (hidden_norm) side by side as the
attention's input [2 x hidden], and the hidden state as the residual; a final norm and an LM head over a reduced
draft vocabulary, whose ids `d2t` maps to the target's. At head position i the input is (token i + 1, the target's
features at i), and the logits guess token i + 2; a further proposal takes the head's own pre-norm output in place
of the target's features (a chain). Names are the public checkpoints' (`jaxserve.weights.eagle3`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.model.attention import attention
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.layers import Linear, RMSNorm
from jaxserve.model.quant import embed
from jaxserve.model.rope import apply_rope, rope_parameters
from jaxserve.parallel.mesh import attention_over_heads, embed_over_vocab, model_size


class Eagle3Layer(nn.Module):
    """attend: None runs the engine's paged attention (`attention` by attention_backend); training passes its own
    (same arguments as `attention`, `kv` whatever it expects), so one definition of the layer serves both."""
    config: HeadConfig
    dtype: Any
    attention_backend: str = "reference"
    mesh: Mesh | None = None
    attend: Callable | None = None

    @nn.compact
    def __call__(self, embeds, hidden, kv, rows):
        """embeds, hidden: [T, H]. Returns (the layer's output before its residual add, the residual, (k, v))."""
        c, dt = self.config, self.dtype
        T = embeds.shape[0]
        whole = model_size(self.mesh) == 1
        e = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(embeds)
        h = RMSNorm(c.rms_norm_eps, dt, name="hidden_norm")(hidden)
        residual = h if c.norm_before_residual else hidden
        x = jnp.concatenate([e, h], axis=-1)  # [T, 2H]
        q = Linear(c.num_heads * c.head_dim, ("embed", "heads"), c.attention_bias, dt, whole, name="q_proj")(x)
        k = Linear(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c.attention_bias, dt, whole, name="k_proj")(x)
        v = Linear(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c.attention_bias, dt, whole, name="v_proj")(x)
        q, k, v = q.reshape(T, c.num_heads, -1), k.reshape(T, c.num_kv_heads, -1), v.reshape(T, c.num_kv_heads, -1)
        inv_freq, factor = rope_parameters(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        q = apply_rope(q, rows.positions, inv_freq, factor)
        k = apply_rope(k, rows.positions, inv_freq, factor)
        attend = self.attend or functools.partial(attention, backend=self.attention_backend)
        attn = attention_over_heads(attend, self.mesh, q, k, v, kv[0], kv[1], rows)
        out = Linear(c.hidden_size, ("heads", "embed"), False, dt, whole, name="o_proj")(attn.reshape(T, -1))
        x = residual + out
        h = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        gate = Linear(c.intermediate_size, ("embed", "mlp"), False, dt, whole, name="gate_proj")(h)
        up = Linear(c.intermediate_size, ("embed", "mlp"), False, dt, whole, name="up_proj")(h)
        return x + Linear(c.hidden_size, ("mlp", "embed"), False, dt, whole, name="down_proj")(nn.silu(gate) * up), \
            (k, v)


class Eagle3Head(nn.Module):
    config: HeadConfig
    dtype: Any = jnp.float32
    attention_backend: str = "reference"
    mesh: Mesh | None = None
    attend: Callable | None = None  # Eagle3Layer's: None is the engine's paged attention

    @nn.compact
    def __call__(self, token_ids, features, hidden, from_target, kv_cache, rows, logits_index=None):
        """token_ids: [T] (at head position i: token i + 1); features: [T, feature_size], the target's at each
        token's position; hidden: [T, H], the head's own output at the position before (a chained token);
        from_target: bool [T], which of the two a token reads; kv_cache: [(k_pages, v_pages)], the head's one layer.
        logits_index: [S] the tokens that get logits (None: all).

        Returns (logits [S or T, draft_vocab_size] float32, each token's pre-norm output [T, H] (a chained token's
        hidden), [(k, v)] of this step, each [T, kv_heads, head_dim]).
        """
        c = self.config
        embeds = head_embeddings(self, c, self.dtype, self.mesh, token_ids)  # [T, H]
        # [T, F] -> [T, H]: computed for chained tokens too (one row each), which then take `hidden`.
        projected = Linear(c.hidden_size, ("features", "embed"), False, self.dtype, model_size(self.mesh) == 1,
                           name="fc")(features.astype(self.dtype))
        hidden = jnp.where(from_target[:, None], projected, hidden.astype(self.dtype))
        out, kv = Eagle3Layer(c, self.dtype, self.attention_backend, self.mesh, self.attend, name="layers_0")(
            embeds, hidden, kv_cache[0], rows)
        x = out if logits_index is None else out[logits_index]
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)
        logits = Linear(c.draft_vocab_size, ("embed", "vocab"), False, self.dtype, model_size(self.mesh) == 1,
                        name="lm_head")(x)
        return logits.astype(jnp.float32), out, [kv]


def head_embeddings(head: nn.Module, c: HeadConfig, dtype, mesh, token_ids):
    """A head's embeddings of token_ids [T] -> [T, H], from the table in its params: the target's (float or int8
    rows, split by vocabulary as the target's) or its own. Called inside the head's compact __call__."""
    if head.has_variable("params", "embed_tokens"):
        table = head.get_variable("params", "embed_tokens")
    else:
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        table = head.param("embed_tokens", init, (c.vocab_size, c.hidden_size), dtype)
    return embed_over_vocab(functools.partial(embed, dtype=dtype), mesh, table, token_ids)


def to_target_vocab(logits, d2t, vocab_size: int):
    """Draft-vocabulary logits [..., Vd] as the target vocabulary's [..., V]: draft id i is target id i + d2t[i]
    (the public checkpoints' offsets); every other target token gets -inf, so nothing samples it."""
    ids = jnp.arange(logits.shape[-1]) + d2t  # [Vd]
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., ids].set(logits)

