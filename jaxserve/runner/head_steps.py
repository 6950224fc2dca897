"""The jitted step of a speculative head (EAGLE-3 or MTP: `jaxserve.model.heads`): a ragged batch of head
positions, proposals sampled on device.

f(params, kv_cache, last_tokens, last_hidden, features, batch) -> (sampled, kv_cache, last_tokens, last_hidden),
all but params and features donated. A token reads the target's captured features at its own cache slot (the
target's step wrote them there: `jaxserve.runner.steps`), or, chained (`StepInput.chain_slot`), the pre-norm output
the head's step before left for its row in `last_hidden`, as its token comes from `last_tokens`: so a chain of k
proposals is k steps dispatched back to back, none waiting for the host. Proposals are drawn as sample() draws, over
the draft vocabulary mapped to target ids, with the row's own sampling parameters and seed (`jaxserve.batching.
speculation.draft`), so verification accepts a proposal where the head and the target agree.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.batch import StepInput, StepOutput
from jaxserve.model.eagle3 import to_target_vocab
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.heads import head_module
from jaxserve.parallel.layouts import lookup_compiler_options
from jaxserve.parallel.mesh import HEADS, MODEL, kv_pages_spec, model_size, replicated, sample_over_vocab, shardings
from jaxserve.runner.placement import BatchPlacer
from jaxserve.runner.steps import IN_PLACE_WRITES, input_tokens, write_cache
from jaxserve.sample.sampling import sample


class HeadSteps:
    def __init__(self, config: HeadConfig, dtype, attention_backend: str = "reference", mesh=None,
                 kv_cache_dtype: str = "auto", platform: str | None = None):
        """platform: what the programs compile for (None: the mesh's devices', or the default device's), as the
        target's `Steps` take it (deviceless compiles: `jaxserve.aot.head_programs`)."""
        self.config = config
        self.model = head_module(config, dtype, attention_backend, mesh)
        self.mesh = mesh
        self.placer = BatchPlacer(mesh)
        platform = platform or (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        # The step looks rows of the embedding table up, as the target's forward does.
        options = lookup_compiler_options(platform) or {}
        # As the target's steps (`jaxserve.runner.steps`): on one CPU device the forward writes the cache in place.
        self.writes_in_forward = mesh is None and platform == "cpu"
        if self.writes_in_forward:
            self._step = jax.jit(self._and_write, donate_argnums=(1, 2, 3),
                                 compiler_options={**options, **IN_PLACE_WRITES})
            self._write = None
        else:
            out: dict = {}
            if mesh is not None:
                rep = replicated(mesh)
                self.cache_sharding = [(shardings(mesh, kv_pages_spec(kv_cache_dtype)),) * 2]
                # This step's (k, v), split with the cache's heads: the cache write takes them where they are.
                self.new_kv_sharding = [(shardings(mesh, HEADS),) * 2]
                out = dict(out_shardings=(rep, self.new_kv_sharding, rep, rep))
            self._step = jax.jit(self._forward, donate_argnums=(2, 3), compiler_options=options or None, **out)
            self._write = jax.jit(write_cache, donate_argnums=0)

    def step(self, params, kv_cache, last_tokens, last_hidden, features, batch: StepInput):
        """params: {"params": the head's, "d2t": int32 [Vd]}; kv_cache: [(k_pages, v_pages)], the head's layer;
        last_tokens [slots + 1] and last_hidden [slots + 1, H]: each row's last proposal and its pre-norm output;
        features [pages x page_size, F]: the target's, read only."""
        batch = self.placer.put(batch)
        out, kv, last_tokens, last_hidden = self._step(params, kv_cache, last_tokens, last_hidden, features, batch)
        if self._write is not None:
            kv = self._write(kv_cache, kv, batch.slot_mapping)
        return out, kv, last_tokens, last_hidden

    def _forward(self, params, kv_cache, last_tokens, last_hidden, features, batch: StepInput):
        tokens = input_tokens(batch, last_tokens)  # [T]
        chained = batch.chain_slot >= 0  # [T]
        hidden = last_hidden[jnp.maximum(batch.chain_slot, 0)]  # [T, H]
        index = batch.logits_index[:, 0]  # [S], -1: the row samples nothing
        heads: Any = self.model.apply(
            {"params": params["params"]}, tokens, features[batch.slot_mapping], hidden, ~chained, kv_cache,
            batch.rows, jnp.maximum(index, 0))
        logits, out_hidden, new_kv = heads
        logits = target_logits(self.mesh, logits, params["d2t"], self.config.vocab_size)  # [S, V]
        s = sample_over_vocab(sample, self.mesh, logits, batch.sampling)
        out = StepOutput(tokens=s.tokens[:, None], num_tokens=jnp.greater_equal(index, 0).astype(jnp.int32),
                         logprobs=s.logprobs[:, None], ranks=s.ranks[:, None], top_ids=s.top_ids[:, None],
                         top_logprobs=s.top_logprobs[:, None])
        last_tokens = last_tokens.at[batch.out_slot].set(s.tokens)  # -1 wraps to the padding slot
        last_hidden = last_hidden.at[batch.out_slot].set(out_hidden[jnp.maximum(index, 0)].astype(last_hidden.dtype))
        return out, new_kv, last_tokens, last_hidden

    def _and_write(self, params, kv_cache, last_tokens, last_hidden, features, batch: StepInput):
        out, new_kv, last_tokens, last_hidden = self._forward(params, kv_cache, last_tokens, last_hidden, features,
                                                              batch)
        kv_cache, out = jax.lax.optimization_barrier((kv_cache, out))
        return out, write_cache(kv_cache, new_kv, batch.slot_mapping), last_tokens, last_hidden

    def num_compiled(self) -> int:
        """Programs compiled so far for serving."""
        programs = [self._step] + ([self._write] if self._write is not None else [])
        # The ignore: jit's C++ wrapper has _cache_size; the JitWrapped stub does not declare it.
        return sum(f._cache_size() for f in programs)  # type: ignore[attr-defined]


def target_logits(mesh, logits, d2t, vocab_size: int):
    """`to_target_vocab` of draft logits [S, Vd] (split by draft vocabulary over a mesh, as the LM head's outputs
    are) into target logits [S, V] split by vocabulary, as `sample_over_vocab` samples them: each device gathers
    the [S, Vd] draft logits and scatters those of its own slice of target ids, so neither the [S, V] logits nor
    the index vector are made whole anywhere (left to the partitioner, the scatter was done replicated, its ids
    exchanged by an all-reduce)."""
    tp = model_size(mesh)
    if tp == 1 or vocab_size % tp:
        return to_target_vocab(logits, d2t, vocab_size)
    split = logits.shape[-1] % tp == 0  # the LM head's outputs split (else whole on every device)
    width = vocab_size // tp

    def local(x, d2t):  # x: [S, Vd / tp] (or [S, Vd])
        if split:
            x = jax.lax.all_gather(x, MODEL, axis=1, tiled=True)  # [S, Vd]
        ids = jnp.arange(x.shape[-1]) + d2t - jax.lax.axis_index(MODEL) * width  # [Vd], in this device's slice
        ids = jnp.where((ids >= 0) & (ids < width), ids, width)  # width: out of range, dropped
        return jnp.full(x.shape[:-1] + (width,), -jnp.inf, x.dtype).at[..., ids].set(x, mode="drop")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(None, MODEL) if split else P(), P()),
                         out_specs=P(None, MODEL), check_vma=False)(logits, d2t)


@functools.cache
def head_steps_for(config: HeadConfig, dtype, attention_backend: str = "reference", mesh=None,
                   kv_cache_dtype: str = "auto") -> HeadSteps:
    return HeadSteps(config, dtype, attention_backend, mesh, kv_cache_dtype)
