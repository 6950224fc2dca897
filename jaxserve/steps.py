"""The pure steps: f(params, kv_cache, batch) -> (sampled, kv_cache), the cache donated.

A batch is a dict of arrays, every one padded to its bucket (see `jaxserve.batching.batch_builder.build_batch`):
    token_ids     int32[S, Q]   new tokens, Q per sequence row (decode: Q = 1)
    positions     int32[S, Q]   their positions in their sequences (-1 for padding)
    slot_mapping  int32[S, Q]   flat cache slot (page * page_size + offset) each new K/V is written to
    page_table    int32[S, P]   pages holding each sequence's tokens cached before this step, in order (this step's
                                keys reach attention directly, so a fresh prompt needs none)
    context_lens  int32[S]      tokens of each sequence in the cache after this step
    logits_index  int32[S]      which of the Q new tokens gets logits (the last real one)
    sampling      dict of per-row arrays (see `jaxserve.sampling.sample`)

A step is two jitted programs: the forward (reads the cache, samples, returns this step's K/V) and the cache write
(donated, in place). Kept apart because XLA cannot see that a write inside the forward comes after the same
layer's read, and on XLA:CPU it then copies every layer's whole cache array every step (measured: 450 ms per
decode step with a 378 MB cache instead of ~30 ms).

`prefill` and `decode` are the same computation with separate jitted forwards, so each keeps its own compiled
programs (a chunk of prompt tokens for one sequence, or one token for each of many).
"""
from __future__ import annotations

import functools

import jax

from jaxserve.attention import write_kv
from jaxserve.config import ModelConfig
from jaxserve.model.llama import LlamaModel
from jaxserve.sampling import sample


def write_cache(kv_cache, new_kv, slot_mapping):
    """kv_cache: per layer (k_pages, v_pages); new_kv: per layer (k, v) [S, Q, kv_heads, head_dim]."""
    return [write_kv(k_pages, v_pages, k, v, slot_mapping) for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


class Steps:
    """The steps for one model architecture and dtype."""

    def __init__(self, config: ModelConfig, dtype):
        self.model = LlamaModel(config, dtype)
        self._prefill = jax.jit(self._forward_and_sample)
        self._decode = jax.jit(self._forward_and_sample)
        self._logits = jax.jit(self._forward_logits)
        self._write = jax.jit(self._write_cache, donate_argnums=0)

    def prefill(self, params, kv_cache, batch):
        """A chunk of prompt tokens (any start position). Returns (sampled dict, kv_cache); kv_cache is donated."""
        return self._run(self._prefill, params, kv_cache, batch)

    def decode(self, params, kv_cache, batch):
        """One new token for each row. Returns (sampled dict, kv_cache); kv_cache is donated."""
        return self._run(self._decode, params, kv_cache, batch)

    def forward_logits(self, params, kv_cache, batch):
        """Logits of every new token, [S, Q, V] float32, and the updated cache (for tests and perplexity)."""
        return self._run(self._logits, params, kv_cache, batch)

    def _run(self, forward, params, kv_cache, batch):
        batch = jax.device_put(batch)  # one host-to-device copy, shared by both programs
        out, new_kv = forward(params, kv_cache, batch)
        return out, self._write(kv_cache, new_kv, batch["slot_mapping"])

    def _forward_and_sample(self, params, kv_cache, batch):
        logits, new_kv = self.model.apply(params, batch["token_ids"], kv_cache, batch, batch["logits_index"])
        return sample(logits, batch["sampling"]), new_kv

    def _write_cache(self, kv_cache, new_kv, slot_mapping):
        return write_cache(kv_cache, new_kv, slot_mapping)  # a method, so each Steps counts its own programs

    def _forward_logits(self, params, kv_cache, batch):
        return self.model.apply(params, batch["token_ids"], kv_cache, batch)

    def num_compiled(self) -> int:
        """Programs compiled so far for serving (forwards and cache writes)."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._write))


@functools.cache
def steps_for(config: ModelConfig, dtype) -> Steps:
    return Steps(config, dtype)
