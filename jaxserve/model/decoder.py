"""The decoder every supported family runs (Llama 2/3, Mistral, Qwen2/3, SmolLM, Gemma 3), as Flax modules over a
paged KV cache.

One forward, with a family's differences read from its config (architecture as data: QK-norm, Gemma's sandwich
norms and GeGLU, embedding scale, per-layer sliding window and RoPE base; see `jaxserve.config.ModelConfig`), not a
model file per family. The modules only define structure; what crosses `jit` is the plain params pytree and the
cache. The model knows the page table it is handed and nothing else about pages. It only reads the cache: it returns
this step's keys and values, and the step writes them (see `jaxserve.runner.steps`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.batch import RaggedRows
from jaxserve.cache import init_kv_cache
from jaxserve.config import ModelConfig
from jaxserve.model.attention import attention, partial_attention
from jaxserve.model.layers import Linear, RMSNorm, rms_norm, with_lora
from jaxserve.model.quant import embed, logical_axes, matmul
from jaxserve.model.rope import apply_rope, rope_parameters
from jaxserve.parallel.context_parallel import attention_over_tokens
from jaxserve.parallel.mesh import attention_over_heads, embed_over_vocab, model_size


class DeclaredParams(NamedTuple):
    """The params tree DecoderModel makes for a config, as declared where its layers make it (no weights)."""
    shapes: dict  # each leaf a ShapeDtypeStruct
    axes: dict  # each leaf's logical axes, a PartitionSpec of names


def declared_params(config: ModelConfig, dtype=jnp.float32) -> DeclaredParams:
    """The params tree of config, each leaf with the logical axes its layer declared. The loaders build the same
    tree (`jaxserve.weights.params`)."""
    def init():
        one = jnp.zeros(1, jnp.int32)
        rows = RaggedRows(positions=one, token_row=one, query_start=jnp.zeros(2, jnp.int32), cached_lens=one,
                          page_table=jnp.zeros((1, 1), jnp.int32))
        return DecoderModel(config, dtype).init(jax.random.key(0), one, init_kv_cache(config, 2, 16, dtype), rows, one)
    boxed = jax.eval_shape(init)
    is_boxed = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    undeclared = [jax.tree_util.keystr(path) for path, leaf in
                  jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_boxed) if not is_boxed(leaf)]
    if undeclared:  # a parameter made without logical axes would silently be replicated
        raise TypeError(f"parameters made without logical axes (nn.with_logical_partitioning): {undeclared}")
    return DeclaredParams(nn.meta.unbox(boxed), nn.get_partition_spec(boxed))


@functools.cache
def _declared_axes(config: ModelConfig) -> dict:
    return declared_params(config).axes


def param_axes(config: ModelConfig, params: dict) -> dict:
    """The logical axes of every leaf of params (loaded, possibly quantized): a tree like params with a
    PartitionSpec of axis names per leaf, as the model declares them; a quantized weight's arrays take their float
    kernel's (`jaxserve.model.quant.logical_axes`)."""
    return jax.tree.map(lambda axes, leaf: logical_axes(leaf, axes), _declared_axes(config), params,
                        is_leaf=lambda x: isinstance(x, P))


def repeat_kv_heads(config: ModelConfig, params: dict, times: int) -> tuple[ModelConfig, dict]:
    """The same model with each KV head repeated `times` over (adjacent copies): a tensor-parallel mesh wider than
    the KV heads gives each device a copy of the one head its query heads read, as vLLM does. Every leaf whose last
    axis is KV heads (k_proj's and v_proj's kernels, biases, int8 / int4 scales) is repeated per head."""
    if times == 1:
        return config, params
    kv, hd = config.num_kv_heads, config.head_dim

    def repeat(axes, leaf):
        return repeat_heads(leaf, hd, times) if axes[-1] == "kv_heads" else leaf

    repeated = jax.tree.map(repeat, param_axes(config, params), params, is_leaf=lambda x: isinstance(x, P))
    return dataclasses.replace(config, num_kv_heads=kv * times), repeated


def repeat_heads(leaf, head_dim: int, times: int):
    """leaf [..., heads * head_dim] with each head repeated `times` over (adjacent copies), as `repeat_kv_heads`
    repeats KV heads (a numpy array stays numpy)."""
    xp = np if isinstance(leaf, np.ndarray) else jnp
    heads = leaf.reshape(*leaf.shape[:-1], -1, head_dim)
    return xp.repeat(heads, times, axis=-2).reshape(*leaf.shape[:-1], -1)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    attention_backend: str = "reference"  # resolved (see jaxserve.model.attention.resolve_attention_backend)
    mesh: Mesh | None = None  # tensor parallel: attention runs per device on its heads
    layer: int = 0  # its index: which window and RoPE base it has
    # Decode context parallelism: the cache split over the mesh by token (jaxserve.parallel.context_parallel).
    context_parallel: bool = False

    @nn.compact
    def __call__(self, x, kv, rows, lora_slot=None):
        """lora_slot: int32 [T], each token's LoRA slot (see Linear), or None: no adapters."""
        c, dt, i = self.config, self.dtype, self.layer
        T, _ = x.shape  # x: [T, hidden], the step's tokens of every row back to back
        whole = model_size(self.mesh) == 1  # each device holds whole kernels
        h = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
        # Logical axes of each kernel's [in, out]: q/k/v split their outputs by head (jaxserve.parallel.mesh.RULES).
        q_axes, kv_axes = ("embed", "heads"), ("embed", "kv_heads")
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.has_variable("params", "qkv_proj"):  # served fused: one dot, split
            qkv = Linear(nq + 2 * nkv, q_axes, c.attention_bias, dt, whole, name="qkv_proj")(h)  # [T, nq + 2 nkv]
            qkv = self._fused_lora(qkv, h, ("q_proj", "k_proj", "v_proj"), lora_slot, whole)
            q, k, v = jnp.split(qkv, [nq, nq + nkv], axis=-1)
        else:
            q = Linear(nq, q_axes, c.attention_bias, dt, whole, name="q_proj")(h, lora_slot)
            k = Linear(nkv, kv_axes, c.attention_bias, dt, whole, name="k_proj")(h, lora_slot)
            v = Linear(nkv, kv_axes, c.attention_bias, dt, whole, name="v_proj")(h, lora_slot)
        q, k, v = q.reshape(T, c.num_heads, -1), k.reshape(T, c.num_kv_heads, -1), v.reshape(T, c.num_kv_heads, -1)
        if c.qk_norm:  # per head, before RoPE
            q = RMSNorm(c.rms_norm_eps, dt, "head_dim", name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, dt, "head_dim", name="k_norm")(k)
        window = c.layer_window(i)
        local_rope = window is not None and c.rope_local_theta is not None  # Gemma's sliding layers: their own base
        inv_freq, attention_factor = rope_parameters(c.head_dim, c.layer_rope_theta(i),
                                                     None if local_rope else c.rope_scaling, c.max_position_embeddings)
        q = apply_rope(q, rows.positions, inv_freq, attention_factor)
        k = apply_rope(k, rows.positions, inv_freq, attention_factor)
        if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != c.head_dim:
            # attention divides by sqrt(head_dim)
            q = q * jnp.asarray((c.head_dim / c.query_pre_attn_scalar) ** 0.5, dt)
        if self.context_parallel:
            attend = functools.partial(partial_attention, sliding_window=window, backend=self.attention_backend)
            attn = attention_over_tokens(attend, self.mesh, q, k, v, kv[0], kv[1], rows)
        else:
            attend = functools.partial(attention, sliding_window=window, backend=self.attention_backend)
            attn = attention_over_heads(attend, self.mesh, q, k, v, kv[0], kv[1], rows)
        # o_proj and down_proj split their inputs (a device holds its heads' / FFN rows' part): one all-reduce each.
        out = Linear(c.hidden_size, ("heads", "embed"), False, dt, whole, name="o_proj")(attn.reshape(T, -1), lora_slot)
        if c.sandwich_norm:
            out = RMSNorm(c.rms_norm_eps, dt, name="attn_output_norm")(out)
        x = x + out
        # The FFN's input norm, under Llama's name for it.
        h = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        if self.has_variable("params", "gate_up_proj"):
            gate_up = Linear(2 * c.intermediate_size, ("embed", "mlp"), False, dt, whole, name="gate_up_proj")(h)
            gate, up = jnp.split(self._fused_lora(gate_up, h, ("gate_proj", "up_proj"), lora_slot, whole), 2, axis=-1)
        else:
            gate = Linear(c.intermediate_size, ("embed", "mlp"), False, dt, whole, name="gate_proj")(h, lora_slot)
            up = Linear(c.intermediate_size, ("embed", "mlp"), False, dt, whole, name="up_proj")(h, lora_slot)
        act = nn.silu(gate) if c.hidden_activation == "silu" else nn.gelu(gate, approximate=True)
        out = Linear(c.hidden_size, ("mlp", "embed"), False, dt, whole, name="down_proj")(act * up, lora_slot)
        if c.sandwich_norm:
            out = RMSNorm(c.rms_norm_eps, dt, name="ffn_output_norm")(out)
        return x + out, (k, v)

    def _fused_lora(self, y, x, targets: tuple[str, ...], lora_slot, whole: bool):
        """A fused projection's output y with its targets' LoRA terms (adapters are per projection: the "lora"
        collection keeps the checkpoint's names, `jaxserve.lora.buffers`), where the step has adapters."""
        if lora_slot is None or not all(self.has_variable("lora", t) for t in targets):
            return y
        ab = [self.get_variable("lora", t) for t in targets]
        return with_lora(y, x, [(t["a"], t["b"]) for t in ab], lora_slot, whole)


class DecoderModel(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    attention_backend: str = "reference"
    mesh: Mesh | None = None
    context_parallel: bool = False  # the cache split over the mesh by token, not by KV head

    @nn.compact
    def __call__(self, token_ids, kv_cache, rows, logits_index=None, return_hidden: bool = False, lora_slot=None,
                 capture: tuple[int, ...] = ()):
        """token_ids: [T]; kv_cache: per layer (k_pages, v_pages), as before this step; rows: `RaggedRows`.

        logits_index: [S] or [S, Q], which tokens get logits (None: all of them).
        Returns (logits [S, V], [S, Q, V] or [T, V] in float32, per layer this step's (k, v), each
        [T, kv_heads, head_dim]), and with return_hidden every token's final hidden state [T, hidden] (before the final
        norm: `lm_head` takes it).
        lora_slot: int32 [T], each token's LoRA adapter slot (-1: none), with the adapters in the "lora" collection
        (`jaxserve.lora.buffers`); None: the base model alone.
        capture: layers whose inputs (num_layers: the final hidden state) a speculative head reads
        (`jaxserve.model.head_config`); given, with return_hidden, they come last: [T, len(capture) * hidden].
        """
        c = self.config
        if self.has_variable("params", "embed_tokens"):  # float or int8 rows (jaxserve.model.quant)
            embedding = self.get_variable("params", "embed_tokens")
        else:
            init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
            embedding = self.param("embed_tokens", init, (c.vocab_size, c.hidden_size), self.dtype)  # split by rows
        x = embed_over_vocab(functools.partial(embed, dtype=self.dtype), self.mesh, embedding, token_ids)  # [T, hidden]
        if c.embedding_multiplier != 1.0:  # in the model's dtype, as HF rounds it
            x = x * jnp.asarray(c.embedding_multiplier, self.dtype)
        new_kv, captured = [], []
        # A Python loop over per-layer weights: on XLA:CPU a scan over stacked layers copies each weight slice.
        for i in range(c.num_layers):
            if i in capture:
                captured.append(x)
            layer = DecoderLayer(c, self.dtype, self.attention_backend, self.mesh, i, self.context_parallel,
                                 name=f"layers_{i}")
            x, kv = layer(x, kv_cache[i], rows, lora_slot)
            new_kv.append(kv)
        hidden = x  # [T, hidden]
        if logits_index is not None:
            x = x[logits_index]  # [S, hidden] or [S, Q, hidden]
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")(x)
        # Always a separate [hidden, vocab] head, even for tied embeddings (the loader copies it): XLA:CPU multiplies
        # by it faster than by the transposed embedding, and a step reads the same bytes either way.
        logits = Linear(c.vocab_size, ("embed", "vocab"), False, self.dtype, model_size(self.mesh) == 1,
                        name="lm_head")(x)  # split by vocab
        if c.num_layers in capture:
            captured.append(hidden)
        if return_hidden and capture:
            return logits.astype(jnp.float32), new_kv, hidden, jnp.concatenate(captured, axis=-1)
        if return_hidden:
            return logits.astype(jnp.float32), new_kv, hidden
        return logits.astype(jnp.float32), new_kv


def lm_head(config: ModelConfig, dtype, params: dict, hidden):
    """What DecoderModel's head computes (the final norm, then lm_head), as a plain function of the params tree:
    logits [..., V] float32 of final hidden states [..., hidden], for code in a lax loop, where a Flax module cannot
    be called."""
    p = params["params"]
    x = rms_norm(hidden, p["norm"]["weight"], config.rms_norm_eps, dtype)
    return matmul(x, p["lm_head"]["kernel"]).astype(jnp.float32)
