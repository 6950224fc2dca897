"""The pure steps: f(params, kv_cache, batch) -> (sampled, kv_cache), the cache donated.

A batch is a dict of arrays, every one padded to its bucket (see `jaxserve.batching.batch_builder.build_batch`):
    token_ids     int32[S, Q]   new tokens, Q per sequence row (decode: Q = 1)
    positions     int32[S, Q]   their positions in their sequences (-1 for padding)
    slot_mapping  int32[S, Q]   flat cache slot (page * page_size + offset) each new K/V is written to
    page_table    int32[S, P]   pages holding each sequence's tokens cached before this step, in order (this step's
                                keys reach attention directly, so a fresh prompt needs none)
    context_lens  int32[S]      tokens of each sequence in the cache after this step
    logits_index  int32[S]      which of the Q new tokens gets logits (the last real one)
    token_slot    int32[S]      >= 0: the row's first token is last_tokens[token_slot], sampled by an earlier step
                                and never copied to the host before this one was dispatched (-1: token_ids holds it)
    out_slot      int32[S]      where `store_tokens` keeps each row's sampled token (-1: the padding slot, the last)
    last_tokens   int32[slots]  optional, on device: the token buffer the two fields above index
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
import jax.numpy as jnp

from jaxserve.attention import write_kv
from jaxserve.config import ModelConfig
from jaxserve.model.llama import LlamaModel
from jaxserve.sampling import sample


def write_cache(kv_cache, new_kv, slot_mapping):
    """kv_cache: per layer (k_pages, v_pages); new_kv: per layer (k, v) [S, Q, kv_heads, head_dim]."""
    return [write_kv(k_pages, v_pages, k, v, slot_mapping) for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


def input_tokens(batch):
    """token_ids [S, Q], with each chained row's first token taken from the device-side buffer of sampled tokens.

    This is what lets the host dispatch step N+1 before step N's tokens reach it.
    """
    token_ids = batch["token_ids"]
    if "last_tokens" not in batch:
        return token_ids
    chained = batch["last_tokens"][jnp.maximum(batch["token_slot"], 0)]
    return token_ids.at[:, 0].set(jnp.where(batch["token_slot"] >= 0, chained, token_ids[:, 0]))


class Steps:
    """The steps for one model architecture and dtype."""

    def __init__(self, config: ModelConfig, dtype, attention_backend: str = "reference"):
        self.model = LlamaModel(config, dtype, attention_backend)
        self._prefill = jax.jit(self._forward_and_sample)
        self._decode = jax.jit(self._forward_and_sample)
        self._logits = jax.jit(self._forward_logits)
        self._write = jax.jit(self._write_cache, donate_argnums=0)
        self._store = jax.jit(self._store_tokens, donate_argnums=0)

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

    def store_tokens(self, last_tokens, out_slot, tokens):
        """Keeps a step's sampled tokens [S] on device in last_tokens [slots] (donated), at out_slot [S]."""
        return self._store(last_tokens, out_slot, tokens)

    def _forward_and_sample(self, params, kv_cache, batch):
        logits, new_kv = self.model.apply(params, input_tokens(batch), kv_cache, batch, batch["logits_index"])
        return sample(logits, batch["sampling"]), new_kv

    def _store_tokens(self, last_tokens, out_slot, tokens):
        return last_tokens.at[out_slot].set(tokens)  # -1 wraps to the padding slot

    def _write_cache(self, kv_cache, new_kv, slot_mapping):
        return write_cache(kv_cache, new_kv, slot_mapping)  # a method, so each Steps counts its own programs

    def _forward_logits(self, params, kv_cache, batch):
        return self.model.apply(params, input_tokens(batch), kv_cache, batch)

    def num_compiled(self) -> int:
        """Programs compiled so far for serving (forwards and cache writes)."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._write, self._store))


@functools.cache
def steps_for(config: ModelConfig, dtype, attention_backend: str = "reference") -> Steps:
    return Steps(config, dtype, attention_backend)
