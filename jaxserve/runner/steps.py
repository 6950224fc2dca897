"""The pure step: f(params, kv_cache, last_tokens, batch) -> (sampled, kv_cache, last_tokens), cache donated.

A batch is a `jaxserve.batch.StepInput`: T new tokens of S rows, back to back (see `jaxserve.batch`). An engine
step is the forward (reads the cache, samples each row's token, keeps it on device in `last_tokens`) and the cache
write (donated, in place). As one program XLA cannot see that a layer's write comes after its read, and copies
every layer's whole cache array every step (XLA:CPU: 450 ms per decode step with a 378 MB cache instead of ~30 ms),
so on accelerators and over a mesh they are two programs. On one CPU device they are one (`writes_in_forward`):
every write waits behind an optimization barrier for the step's output, which every layer's read feeds, and
copy insertion's region analysis (`IN_PLACE_WRITES`) then sees that no read follows a write: no copy, and one
program call less a step, whose host time a CPU takes from the step itself (BENCHMARKS.md, issue 28).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batch import StepInput, StepOutput, constant
from jaxserve.config import ModelConfig
from jaxserve.model.attention import write_kv
from jaxserve.model.decoder import DecoderModel, lm_head, param_axes
from jaxserve.parallel.context_parallel import (
    check_context_parallel,
    pages_by_token,
    whole_kv_heads,
    write_over_tokens,
)
from jaxserve.parallel.layouts import lookup_compiler_options
from jaxserve.parallel.mesh import (
    HEADS,
    features_sharding,
    head_over_vocab,
    kv_pages_spec,
    model_size,
    param_shardings,
    replicated,
    sample_over_vocab,
    shardings,
)
from jaxserve.runner.placement import BatchPlacer
from jaxserve.sample.prompt_logprobs import block_scores, score_targets
from jaxserve.sample.sampling import (
    last_input_tokens,
    sample,
    skipped_sample,
    with_step_tokens,
    with_words_banned,
)
from jaxserve.sample.verification import verify

# The row counts a step's LM head and sampler run at below its own (`Steps._sample_used_rows`): a step of few
# sequences then pays for those, not for its padded rows. Not 1: a one-row bf16 or int8 dot is XLA:CPU's slow loop.
HEAD_ROWS = (4, 16)
# XLA:CPU's compiler options for a forward that writes the cache: copy insertion that follows the barrier's order.
IN_PLACE_WRITES = {"xla_cpu_copy_insertion_use_region_analysis": True}


def write_cache(kv_cache, new_kv, slot_mapping):
    """kv_cache: per layer (k_pages, v_pages); new_kv: per layer (k, v) [T, kv_heads, head_dim]."""
    return [write_kv(k_pages, v_pages, k, v, slot_mapping) for (k_pages, v_pages), (k, v) in zip(kv_cache, new_kv)]


@dataclasses.dataclass
class SplitForward:
    """A split step's first half, on device (`Steps.sample_joined` samples its rows)."""
    output: StepOutput  # its prompt scores; its rows sampled nothing
    rows: jax.Array  # [S, hidden]: each row's final hidden state at its last token
    last: jax.Array  # int32 [S]: each row's last input token (a chained one's known only on device)
    batch: StepInput  # as placed
    penalties: Any  # the penalties' counts with this step's tokens counted in (None: none kept)


def input_tokens(batch: StepInput, last_tokens):
    """token_ids [T], a chained token taken from the device-side buffer of tokens sampled by the step before.

    This is what lets the host dispatch step N+1 before step N's tokens reach it.
    """
    chained = last_tokens[jnp.maximum(batch.chain_slot, 0)]
    return jnp.where(batch.chain_slot >= 0, chained, batch.token_ids)


class Steps:
    """The steps for one model architecture and dtype.

    With num_speculative_tokens = k > 0 there is a second forward program, the verification step: it scores k + 1
    tokens per row and accepts proposals on device (`jaxserve.sample.verification`). Plain steps keep their own
    program, whose LM head and sampler see one token per row.
    """

    def __init__(self, config: ModelConfig, dtype, attention_backend: str = "reference",
                 num_speculative_tokens: int = 0, mesh=None, kv_cache_dtype: str = "auto",
                 platform: str | None = None, decode_context_parallel_size: int = 1, capture: tuple[int, ...] = ()):
        """mesh: a device group's [data=1, model] mesh for tensor parallelism (None: one device). The programs'
        outputs are pinned to the shardings their inputs arrive in (params and cache placed by the runner, the
        batch replicated), so a step never reshards anything. platform: what the programs compile for (None: the
        mesh's devices', or the default device's), for the compiler options of the programs that embed tokens.
        decode_context_parallel_size: the mesh's size, to split the cache over it by token (pages of that many
        times the host's page size / d tokens a device: `jaxserve.parallel.context_parallel`), or 1.
        capture: the layers whose inputs a speculative head reads (`jaxserve.model.head_config`): every step then
        keeps its tokens' [T, F] of them by cache slot (`step_with_features`), as it keeps their K/V."""
        check_context_parallel(config, model_size(mesh), decode_context_parallel_size, attention_backend)
        self.context_parallel = decode_context_parallel_size > 1
        self.config = config
        # every family's (jaxserve.model.families)
        self.model = DecoderModel(config, dtype, attention_backend, mesh, self.context_parallel)
        self.num_speculative_tokens = num_speculative_tokens
        self.mesh = mesh
        self.capture = tuple(capture)
        forward: dict[str, Any]  # each program's jax.jit options
        logits: dict[str, Any]
        write: dict[str, Any]
        platform = platform or (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        if mesh is not None:
            rep = replicated(mesh)
            # This step's (k, v) per layer: split with the cache's heads, or whole where the cache splits by token.
            new_kv = rep if self.context_parallel else shardings(mesh, HEADS)
            self.new_kv_sharding = [(new_kv,) * 2] * config.num_layers
            pages = (pages_by_token(mesh, kv_cache_dtype, platform) if self.context_parallel
                     else shardings(mesh, kv_pages_spec(kv_cache_dtype)))
            self.cache_sharding = [(pages,) * 2] * config.num_layers
            # The captured features [slots, F], split by column (a device writes its columns of the replicated states).
            self.features_sharding = features_sharding(mesh, len(self.capture) * config.hidden_size)
            forward = dict(out_shardings=(rep, self.new_kv_sharding, rep, self.features_sharding, rep))
            logits = dict(out_shardings=(rep, self.new_kv_sharding))
            write = dict(out_shardings=self.cache_sharding)
        else:
            forward = logits = write = {}
        # The forward programs look up rows.
        embeds: dict[str, Any] = dict(compiler_options=lookup_compiler_options(platform))
        forward, logits = {**forward, **embeds}, {**logits, **embeds}
        # One CPU device: the step's forward also writes the cache (module docstring); elsewhere `_write` does.
        self.writes_in_forward = mesh is None and platform == "cpu"
        if self.writes_in_forward:
            in_place: dict[str, Any] = dict(compiler_options={**(embeds["compiler_options"] or {}), **IN_PLACE_WRITES})
            self._forward = jax.jit(functools.partial(self._and_write, self._forward_and_sample),
                                    donate_argnums=(1, 2, 5, 6), **in_place)
            self._verify = jax.jit(functools.partial(self._and_write, self._forward_and_verify),
                                   donate_argnums=(1, 2, 5, 6), **in_place)
        else:
            self._forward = jax.jit(self._forward_and_sample, donate_argnums=(2, 5, 6), **forward)
            self._verify = jax.jit(self._forward_and_verify, donate_argnums=(2, 5, 6), **forward)
        # A split step's sampling half (`sample_joined`): one program per row bucket, compiled at warm-up.
        self._split_sample = jax.jit(self._sample_joined, donate_argnums=7)
        self._logits = jax.jit(self._forward_logits, **logits)
        self._write = jax.jit(self._write_cache, donate_argnums=0, **write)
        self.placer = BatchPlacer(mesh)

    def param_shardings(self, params):
        """Where each leaf of params (loaded, possibly quantized) lives on the mesh: split as the model declares
        its parameters' logical axes (`jaxserve.model.decoder.param_axes`, `jaxserve.parallel.mesh.RULES`)."""
        axes = param_axes(self.config, params)
        return param_shardings(self.mesh, params, whole_kv_heads(axes) if self.context_parallel else axes)

    def put_batch(self, batch: StepInput) -> StepInput:
        """A step's inputs as its programs take them (`jaxserve.runner.placement.BatchPlacer`)."""
        return self.placer.put(batch)

    def step(self, params, kv_cache, last_tokens, batch: StepInput, lora=None):
        """One ragged step. Returns (StepOutput, kv_cache, last_tokens); kv_cache and last_tokens [slots] are
        donated: each row's last emitted token is kept at last_tokens[out_slot] for a later step to chain from.
        A batch whose logits_index is [S, k + 1] runs the verification program. A draft model's steps are plain
        ones: its proposals are drawn as sample() draws, with the sequence's seed and generated token numbers.
        lora: the LoRA adapters' buffers (`jaxserve.lora.buffers`) that batch.lora_slot indexes, or None (no
        adapters: the base model's programs)."""
        return self.step_with_features(params, kv_cache, last_tokens, None, batch, lora)[:3]

    def step_with_features(self, params, kv_cache, last_tokens, features, batch: StepInput, lora=None,
                           penalties=None):
        """step(), also keeping the captured layers' inputs of each new token at its cache slot: features
        [num_pages * page_size, F] (None without capture), donated and returned as the fourth result; and the
        penalties' counts per slot (`jaxserve.sample.penalty_counts.PenaltyCounts`, None: the runner keeps none
        and the penalties count each row's past_tokens), donated and returned as the fifth."""
        split = not self.samples(batch)
        batch = self.put_batch(batch)
        program = self._verify if batch.logits_index.shape[1] > 1 else self._forward
        # kv: the cache, or its new K/V; rows, last: a plain step's rows' final hidden states and last input tokens
        # (`sample_joined`)
        (out, rows, last), kv, last_tokens, features, penalties = program(params, kv_cache, last_tokens, batch, lora,
                                                                          features, penalties)
        kv = kv if self.writes_in_forward else self._write(kv_cache, kv, batch.slot_mapping)
        if split:
            out = SplitForward(out, rows, last, batch, penalties)
        return out, kv, last_tokens, features, penalties

    @staticmethod
    def samples(batch: StepInput) -> bool:
        """Whether a step over batch samples its rows (False: the first half of a split step)."""
        return bool(np.asarray(batch.sample_rows))

    def sample_joined(self, params, split: SplitForward, last_tokens, masks):
        """The second half of a split step (whose first, `step_with_features` over a batch with sample_rows False,
        ran the forward, wrote the cache and counted the penalties, and sampled no row): each row's masks
        [S, ceil(V / 32)] int32 ANDed on device with the row's own (allowed tokens, bans), then the rows sample as a
        whole step's would. One program for each row bucket, whatever the step's tokens or table. Returns
        (StepOutput, last_tokens), last_tokens donated."""
        batch = split.batch
        # No row's history ([S, 1] of none, so that one program serves every table width): a split step's penalty
        # rows count in their slots (`jaxserve.runner.penalty_slots`).
        S = batch.num_rows
        sampling = dataclasses.replace(batch.sampling, past_tokens=constant((S, 1), np.int32, self.config.vocab_size))
        out, last_tokens = self._split_sample(params, split.rows, split.last, sampling, batch.logits_index[:, 0],
                                              batch.out_slot, split.penalties, last_tokens, masks)
        return dataclasses.replace(out, prompt=split.output.prompt), last_tokens

    def _sample_joined(self, params, x, last, sampling, last_index, out_slot, penalties, last_tokens, masks):
        # The bad words the rows' last input tokens complete, as the whole step bans them (`with_step_tokens`).
        mask = with_words_banned(sampling, last) & masks
        sampling = dataclasses.replace(sampling, token_mask=mask, penalty_state=penalties)
        s = self._sample_used_rows(params, x, last_index, sampling, gathered=True)
        return self._step_output(s, last_index, None), last_tokens.at[out_slot].set(s.tokens)

    @staticmethod
    def _step_output(s, last_index, prompt) -> StepOutput:
        """A plain step's output from its rows' samples s; last_index [S] (-1: the row samples nothing)."""
        num_tokens = jnp.greater_equal(last_index, 0).astype(jnp.int32)  # [S] 1: the row samples
        return StepOutput(tokens=s.tokens[:, None], num_tokens=num_tokens,
                          logprobs=s.logprobs[:, None], ranks=s.ranks[:, None], top_ids=s.top_ids[:, None],
                          top_logprobs=s.top_logprobs[:, None], prompt=prompt)

    def _keep_features(self, features, hidden_and_features, batch: StepInput):
        """features with this step's captured [T, F] written at its tokens' slots (padding: the scratch page's)."""
        if not self.capture:
            return features
        captured = hidden_and_features[1].astype(features.dtype)  # [T, F]
        if self.mesh is not None:
            # Whole on every device, as the residual stream is: each keeps its own columns. Left free, the partitioner
            # carries the buffer's column split back into the layers and exchanges their states (all-to-alls).
            captured = jax.lax.with_sharding_constraint(captured, replicated(self.mesh))
        return features.at[batch.slot_mapping].set(captured)

    def forward_logits(self, params, kv_cache, batch: StepInput, lora=None):
        """Logits of every new token, [T, V] float32, and the updated cache (for tests and perplexity)."""
        batch = self.put_batch(batch)
        logits, new_kv = self._logits(params, kv_cache, batch, lora)
        return logits, self._write(kv_cache, new_kv, batch.slot_mapping)

    def _prompt_scores(self, params, hidden, batch: StepInput):
        """The logprobs of the prompt tokens the batch asks for (`jaxserve.sample.prompt_logprobs`): the LM head runs
        only over the tokens that ask, a block at a time (none: not at all); over a mesh, on each device's slice of
        the vocabulary."""
        specs = None if self.mesh is None else jax.tree.map(lambda s: s.spec, self.param_shardings(params))
        score = head_over_vocab(block_scores, functools.partial(lm_head, self.config, self.model.dtype), self.mesh,
                                params, specs)
        return score_targets(hidden, batch.prompt_targets, batch.prompt_top, score, self.config.vocab_size)

    def _apply(self, params, lora, batch: StepInput, *args, **kw):
        """The model over params, with the LoRA adapters if there are any (None: exactly the base model's program:
        batch.lora_slot is then unused, so jit prunes it)."""
        if lora is None:
            return self.model.apply(params, *args, **kw)
        return self.model.apply({**params, "lora": lora}, *args, **kw, lora_slot=batch.lora_slot)

    def _plain_forward(self, params, kv_cache, last_tokens, batch: StepInput, lora=None, penalties=None):
        """A plain step's forward: (logits, new K/V, [hidden, captured features], the rows' sampling parameters with
        what only the device knows of their tokens, the penalties' counts included, each row's last input token)."""
        tokens = input_tokens(batch, last_tokens)
        logits, new_kv, *captured = self._apply(params, lora, batch, tokens, kv_cache, batch.rows,
                                                batch.logits_index[:, 0], return_hidden=True, capture=self.capture)
        sampling = with_step_tokens(dataclasses.replace(batch.sampling, penalty_state=penalties), tokens, batch.rows,
                                    batch.logits_index[:, 0])
        return logits, new_kv, captured, sampling, last_input_tokens(tokens, batch.logits_index[:, 0])

    def _forward_and_sample(self, params, kv_cache, last_tokens, batch: StepInput, lora=None, features=None,
                            penalties=None):
        logits, new_kv, captured, sampling, last = self._plain_forward(params, kv_cache, last_tokens, batch, lora,
                                                                       penalties)
        hidden = captured[0]
        x = hidden[jnp.maximum(batch.logits_index[:, 0], 0)]  # [S, hidden]: each row's, for a split step's sampling
        if self.mesh is None and batch.logits_index.shape[0] > HEAD_ROWS[0]:
            # The first half of a split step (sample_rows False) runs no head: its rows sample in `sample_joined`.
            s = self._sample_used_rows(params, x, batch.logits_index[:, 0], sampling, gathered=True,
                                       skip=~batch.sample_rows)
        else:  # few rows: their logits are the model's already, and sampling them twice costs little
            s = sample_over_vocab(sample, self.mesh, logits, sampling)
        out = self._step_output(s, batch.logits_index[:, 0], self._prompt_scores(params, hidden, batch))
        last_tokens = last_tokens.at[batch.out_slot].set(s.tokens)  # -1 wraps to the padding slot
        return ((out, x, last), new_kv, last_tokens, self._keep_features(features, captured, batch),
                sampling.penalty_state)

    def _sample_used_rows(self, params, hidden, last_index, sampling, gathered: bool = False, skip=False):
        """sample() over the rows up to the last that samples, the LM head included, run at the smallest of
        HEAD_ROWS that holds them: a step's rows are min(tokens, max_num_seqs) (`jaxserve.buckets`), so a lone
        prompt's 64-token step has 64 rows, and a head over them all is most of its time where the vocabulary is
        large (Gemma 3's 262k). The other rows' results are zeros: nothing reads them. The model's own logits go
        unused, and jit drops their head. hidden [T, hidden]; last_index [S] (-1: the row samples nothing);
        gathered: hidden is already each row's [S, hidden] at last_index. skip (a traced bool): no row samples (all
        zeros, no head)."""
        S = last_index.shape[0]
        x = hidden if gathered else hidden[jnp.maximum(last_index, 0)]  # [S, hidden]
        used = jnp.max(jnp.where(last_index >= 0, jnp.arange(1, S + 1), 0))
        sizes = [b for b in HEAD_ROWS if b < S] + [S]

        def over(b):
            def run(x, sampling):
                # The counts are by slot, not by row: only the rows' own arrays are cut.
                rows = jax.tree.map(lambda a: a[:b], dataclasses.replace(sampling, penalty_state=None))
                rows = dataclasses.replace(rows, penalty_state=sampling.penalty_state)
                if b == 0:  # no row samples
                    return skipped_sample(S)
                s = sample(lm_head(self.config, self.model.dtype, params, x[:b]), rows)
                return jax.tree.map(lambda a: jnp.pad(a, [(0, S - b)] + [(0, 0)] * (a.ndim - 1)), s)
            return run

        which = jnp.where(skip, 0, 1 + sum((used > b).astype(jnp.int32) for b in sizes[:-1]))
        return jax.lax.switch(which, [over(0)] + [over(b) for b in sizes], x, sampling)

    def _forward_and_verify(self, params, kv_cache, last_tokens, batch: StepInput, lora=None, features=None,
                            penalties=None):
        tokens = input_tokens(batch, last_tokens)  # [T]
        index = jnp.maximum(batch.logits_index, 0)  # [S, Q]
        T, (S, Q) = tokens.shape[0], index.shape
        if T <= S * Q:  # the LM head over every token costs less than over every (row, position)
            logits, new_kv, *captured = self._apply(params, lora, batch, tokens, kv_cache, batch.rows,
                                                    return_hidden=True, capture=self.capture)
            logits = logits[index]  # [S, Q, V]
        else:
            logits, new_kv, *captured = self._apply(params, lora, batch, tokens, kv_cache, batch.rows, index,
                                                    return_hidden=True, capture=self.capture)
        hidden = captured[0]
        # The proposal a scored position is checked against is the token after it in the row.
        drafts = tokens[jnp.minimum(index[:, :-1] + 1, T - 1)]  # [S, Q - 1]
        # Rows whose logit controls depend on the tokens before a position do not speculate: position 0 is theirs.
        sampling = with_step_tokens(dataclasses.replace(batch.sampling, penalty_state=penalties), tokens, batch.rows,
                                    batch.logits_index[:, 0])
        v = sample_over_vocab(verify, self.mesh, logits, drafts, batch.num_draft, sampling)
        num_tokens = jnp.where(batch.logits_index[:, 0] >= 0, v.num_tokens, 0)  # [S]
        out = StepOutput(tokens=v.tokens, num_tokens=num_tokens, logprobs=v.logprobs, ranks=v.ranks,
                         top_ids=v.top_ids, top_logprobs=v.top_logprobs,
                         prompt=self._prompt_scores(params, hidden, batch))
        last = jnp.take_along_axis(v.tokens, jnp.maximum(num_tokens - 1, 0)[:, None], axis=1)[:, 0]  # [S]
        return ((out, None, None), new_kv, last_tokens.at[batch.out_slot].set(last),
                self._keep_features(features, captured, batch), sampling.penalty_state)

    @staticmethod
    def _and_write(forward, params, kv_cache, last_tokens, batch: StepInput, lora=None, features=None,
                   penalties=None):
        """forward's results with the cache written, every write after every layer's read (module docstring)."""
        out, new_kv, last_tokens, features, penalties = forward(params, kv_cache, last_tokens, batch, lora, features,
                                                                penalties)
        kv_cache, out = jax.lax.optimization_barrier((kv_cache, out))
        return out, write_cache(kv_cache, new_kv, batch.slot_mapping), last_tokens, features, penalties

    def _write_cache(self, kv_cache, new_kv, slot_mapping):  # a method, so each Steps counts its own programs
        if self.context_parallel:
            return write_over_tokens(self.mesh, kv_cache, new_kv, slot_mapping)
        return write_cache(kv_cache, new_kv, slot_mapping)

    def _forward_logits(self, params, kv_cache, batch: StepInput, lora=None):
        return self._apply(params, lora, batch, batch.token_ids, kv_cache, batch.rows)

    def num_compiled(self) -> int:
        """Programs compiled so far for serving (forwards, cache writes, split steps' sampling halves)."""
        # The ignore: jit's C++ wrapper has _cache_size; the JitWrapped stub does not declare it.
        return sum(f._cache_size() for f in (self._forward, self._verify, self._write, self._split_sample))  # type: ignore[attr-defined]


@functools.cache
def steps_for(config: ModelConfig, dtype, attention_backend: str = "reference", num_speculative_tokens: int = 0,
              mesh=None, kv_cache_dtype: str = "auto", decode_context_parallel_size: int = 1,
              capture: tuple[int, ...] = ()) -> Steps:
    return Steps(config, dtype, attention_backend, num_speculative_tokens, mesh, kv_cache_dtype,
                 decode_context_parallel_size=decode_context_parallel_size, capture=capture)
