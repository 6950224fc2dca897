"""Deviceless compile of a speculative head's program (EAGLE-3): the head's step at each of the engine's buckets,
with its cache write where that is a program of its own, from abstract parameters, as `HeadSteps` runs it (its
params split as `declared_head_params` declares them, the embedding the target's table, its one-layer cache split
over KV heads, the captured features split by column). The target's steps that capture those features are
`compile_serving`'s (head=...)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.aot.step_programs import abstract_batch, step_and_write
from jaxserve.cache import init_kv_cache
from jaxserve.config import ModelConfig
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.heads import declared_head_params
from jaxserve.parallel.layouts import param_formats
from jaxserve.parallel.mesh import features_sharding, param_shardings, replicated
from jaxserve.runner.head_steps import HeadSteps

# Public heads' shapes (their config.json): yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, for Llama 3.1 8B Instruct (the
# shape of `MODEL_CONFIGS["llama-3-8b"]`): one Llama 3 8B layer over [embedding, hidden], a 32000-token draft
# vocabulary, the inputs of layers 2, 16 and 29.
HEAD_CONFIGS = {
    "llama-3-8b": HeadConfig(kind="eagle3", hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                             head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096,
                             feature_layers=(2, 16, 29), rms_norm_eps=1e-5, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             max_position_embeddings=131072),
}


def head_for(name: str, target: ModelConfig) -> HeadConfig:
    """The public head of model `name`, reading layers that `target` has: a target compiled with fewer layers
    (`with_layers`) has its low, middle and last layers' inputs read instead, as many as the head reads."""
    head = HEAD_CONFIGS[name]
    if head.feature_layers[-1] <= target.num_layers:
        return head
    L = target.num_layers
    layers = tuple(sorted({0, L // 2, L}))
    if len(layers) != len(head.feature_layers):
        raise ValueError(f"a {L}-layer target has too few layers for the head's {len(head.feature_layers)} features")
    return dataclasses.replace(head, feature_layers=layers)


def abstract_head_params(head: HeadConfig, dtype) -> dict:
    """The head's params as `HeadRunner` holds them ({"params": ..., the embedding included; "d2t": int32 [Vd]}),
    shapes only."""
    shapes = declared_head_params(head, dtype).shapes
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), shapes)
    return {**params, "d2t": jax.ShapeDtypeStruct((head.draft_vocab_size,), jnp.int32)}


def compile_head(head: HeadConfig, dtype, shapes, compile_, *, device, mesh, platform: str, attention_backend: str,
                 num_pages: int, page_size: int, pages_per_row: int, max_num_seqs: int, kv_cache_dtype: str,
                 lanes: int) -> list:
    """The head's step (and cache write) at each (tokens, rows) of shapes, through `compile_serving`'s compile_
    (program, shape, fn, args, arg_shardings, roles). The embedding table is placed as the target's
    (`jaxserve.parallel.layouts.param_formats`): it is the same array."""
    steps = HeadSteps(head, dtype, attention_backend, mesh, kv_cache_dtype, platform)
    params = abstract_head_params(head, dtype)
    kv = jax.eval_shape(lambda: init_kv_cache(head.layer_config(), num_pages, page_size, dtype, kv_cache_dtype,
                                              lanes))
    sds = jax.ShapeDtypeStruct
    last_tokens = sds((max_num_seqs + 1,), jnp.int32)
    last_hidden = sds((max_num_seqs + 1, head.hidden_size), dtype)
    features = sds((num_pages * page_size, head.feature_size), dtype)
    if mesh is None:
        where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), params)
        cache = new_kv = None
    else:
        axes = declared_head_params(head, dtype).axes
        where = {**param_shardings(mesh, {"params": params["params"]}, axes), "d2t": replicated(mesh)}
        cache, new_kv = steps.cache_sharding, steps.new_kv_sharding
    features_at = None if mesh is None else features_sharding(mesh, head.feature_size)
    step_shardings = (param_formats(params, where), cache, None, None, features_at, None)
    results = []
    for tokens, rows in shapes:
        batch = abstract_batch(page_size, head.vocab_size, tokens, rows, pages_per_row)
        results += step_and_write(compile_, "head ", f"{tokens} tokens x {rows} rows", steps, steps._step,
                                  (params, kv, last_tokens, last_hidden, features, batch), step_shardings,
                                  (cache, new_kv, None))
    return results
