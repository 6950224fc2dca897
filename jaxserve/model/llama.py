"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) as Flax modules over a paged KV cache.

The modules only define structure; what crosses `jit` is the plain params pytree and the cache. The model knows the
page table it is handed and nothing else about pages. It only reads the cache: it returns this step's keys and
values, and the step writes them (see `jaxserve.steps`).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.attention import attention
from jaxserve.config import ModelConfig
from jaxserve.model.rope import apply_rope, inverse_frequencies
from jaxserve.quant import embed, matmul


class Linear(nn.Module):
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        # kernel: [in, out], float or quantized (jaxserve.quant). A quantized kernel's leaves do not have the float
        # kernel's shape, so an existing kernel is read as is rather than through param()'s shape check.
        if self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")
        else:
            kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.dtype)
        y = matmul(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return (x32 * weight.astype(jnp.float32)).astype(self.dtype)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    attention_backend: str = "reference"  # resolved (see jaxserve.attention.resolve_attention_backend)

    @nn.compact
    def __call__(self, x, kv, rows):
        c, dt = self.config, self.dtype
        T, _ = x.shape  # x: [T, hidden], the step's tokens of every row back to back
        h = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
        q = Linear(c.num_heads * c.head_dim, c.attention_bias, dt, name="q_proj")(h)
        k = Linear(c.num_kv_heads * c.head_dim, c.attention_bias, dt, name="k_proj")(h)
        v = Linear(c.num_kv_heads * c.head_dim, c.attention_bias, dt, name="v_proj")(h)
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        q = apply_rope(q.reshape(T, c.num_heads, c.head_dim), rows.positions, inv_freq)
        k = apply_rope(k.reshape(T, c.num_kv_heads, c.head_dim), rows.positions, inv_freq)
        v = v.reshape(T, c.num_kv_heads, c.head_dim)
        attn = attention(q, k, v, kv[0], kv[1], rows, sliding_window=c.sliding_window, backend=self.attention_backend)
        x = x + Linear(c.hidden_size, False, dt, name="o_proj")(attn.reshape(T, -1))
        h = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        gate = Linear(c.intermediate_size, False, dt, name="gate_proj")(h)
        up = Linear(c.intermediate_size, False, dt, name="up_proj")(h)
        x = x + Linear(c.hidden_size, False, dt, name="down_proj")(nn.silu(gate) * up)
        return x, (k, v)


class LlamaModel(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, token_ids, kv_cache, rows, logits_index=None):
        """token_ids: [T]; kv_cache: per layer (k_pages, v_pages), as before this step; rows: `RaggedRows`.

        logits_index: [S] or [S, Q], which tokens get logits (None: all of them).
        Returns (logits [S, V], [S, Q, V] or [T, V] in float32, per layer this step's (k, v), each [T, kv_heads, head_dim]).
        """
        c = self.config
        if self.has_variable("params", "embed_tokens"):  # float or int8 rows (jaxserve.quant)
            embedding = self.get_variable("params", "embed_tokens")
        else:
            embedding = self.param("embed_tokens", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                                   self.dtype)
        x = embed(embedding, token_ids, self.dtype)  # [T, hidden]
        new_kv = []
        # A Python loop over per-layer weights: on XLA:CPU a scan over stacked layers copies each weight slice.
        for i in range(c.num_layers):
            x, kv = DecoderLayer(c, self.dtype, self.attention_backend, name=f"layers_{i}")(x, kv_cache[i], rows)
            new_kv.append(kv)
        if logits_index is not None:
            x = x[logits_index]  # [S, hidden] or [S, Q, hidden]
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)
        # Always a separate [hidden, vocab] head, even for tied embeddings (the loader copies it): XLA:CPU multiplies
        # by it faster than by the transposed embedding, and a step reads the same bytes either way.
        logits = Linear(c.vocab_size, False, self.dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), new_kv
