"""The pure jitted steps: f(params, kv_cache, batch) -> (sampled, kv_cache), the cache donated.

A batch is a dict of arrays, every one padded to its bucket (see `jaxserve.batching.batch_builder.build_batch`):
    token_ids     int32[S, Q]   new tokens, Q per sequence row (decode: Q = 1)
    positions     int32[S, Q]   their positions in their sequences (-1 for padding)
    slot_mapping  int32[S, Q]   flat cache slot (page * page_size + offset) each new K/V is written to
    page_table    int32[S, P]   pages of each sequence, in order
    context_lens  int32[S]      tokens of each sequence in the cache after this step
    logits_index  int32[S]      which of the Q new tokens gets logits (the last real one)
    sampling      dict of per-row arrays (see `jaxserve.sampling.sample`)

`prefill` and `decode` are the same computation; they are separate jitted entry points so each keeps its own
compiled programs (a chunk of prompt tokens for one sequence, or one token for each of many).
"""
from __future__ import annotations

import functools

import jax

from jaxserve.config import ModelConfig
from jaxserve.model.llama import LlamaModel
from jaxserve.sampling import sample


class Steps:
    """The jitted steps for one model architecture and dtype."""

    def __init__(self, config: ModelConfig, dtype):
        self.model = LlamaModel(config, dtype)
        self.prefill = jax.jit(self._step, donate_argnums=1)
        self.decode = jax.jit(self._step, donate_argnums=1)
        self.forward_logits = jax.jit(self._forward_logits, donate_argnums=1)

    def _step(self, params, kv_cache, batch):
        logits, kv_cache = self.model.apply(params, batch["token_ids"], kv_cache, batch, batch["logits_index"])
        return sample(logits, batch["sampling"]), kv_cache

    def _forward_logits(self, params, kv_cache, batch):
        """Logits for every new token, [S, Q, V] float32 (tests and perplexity; not used while serving)."""
        return self.model.apply(params, batch["token_ids"], kv_cache, batch)

    def num_compiled(self) -> int:
        return sum(f._cache_size() for f in (self.prefill, self.decode))


@functools.cache
def steps_for(config: ModelConfig, dtype) -> Steps:
    return Steps(config, dtype)
