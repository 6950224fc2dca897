"""A step's inputs and outputs: typed pytrees over one ragged batch.

A step computes T new tokens (padded to a bucket) for S rows (padded to min(T, max_num_seqs)), one row per
sequence: its new tokens sit back to back in the flat token array, whatever their number (one for a decode, a
prompt chunk's worth for a prefill, k + 1 for a verification). Every matmul runs over the flat [T] tokens, so a
step reads each weight once however its tokens split between sequences; only attention sees the rows.
`jaxserve.runner.batch_builder` is the one place that builds these from scheduled sequences.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

# A step's arrays: numpy as the host builds them (`jaxserve.runner.batch_builder`), device arrays (or tracers) after.
StepArray = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedRows:
    """What attention needs to know of the rows."""
    positions: StepArray  # int32 [T]   each token's position in its sequence (-1: padding, attends to nothing)
    token_row: StepArray  # int32 [T]   each token's row (padding tokens: row 0; their position hides them)
    query_start: StepArray  # int32 [S + 1]   row r's tokens are token_ids[query_start[r]:query_start[r + 1]]
    cached_lens: StepArray  # int32 [S]   tokens of each row in the cache before this step: keys 0 .. len - 1
    page_table: StepArray  # int32 [S, P]   pages holding each row's cached tokens, in order (scratch page padded)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInput:
    """Per row; see `jaxserve.sample.sampling.sample`."""
    temperature: StepArray  # float32 [S]   0: greedy
    top_k: StepArray  # int32 [S]   0: off
    top_p: StepArray  # float32 [S]
    min_p: StepArray  # float32 [S]
    seed: StepArray  # uint32 [S]
    step: StepArray  # int32 [S]   tokens generated so far: with the seed, a reproducible draw
    banned: StepArray  # int32 [S, MAX_BANNED_TOKENS]   may not be sampled as the g-th generated token while
    #                                         g < min_tokens (padded with vocab_size)
    min_tokens: StepArray  # int32 [S]
    want_top_logprobs: StepArray  # bool [S]
    token_mask: StepArray  # int32 [S, ceil(V / 32)]   the tokens a row may sample (`jaxserve.sample.token_mask`;
    #                                         -1: all)
    # Logit controls (`jaxserve.sample.sampling.controlled`); a batch where no row uses one holds a `constant` for it.
    bad_word_bans: StepArray  # int32 [S, MAX_BAD_WORD_BANS, 2]   (trigger, banned): banned may not follow the row's
    #                                         last token if it is trigger (padded with vocab_size)
    logit_bias_ids: StepArray  # int32 [S, MAX_LOGIT_BIAS]   padded with vocab_size
    logit_bias: StepArray  # float32 [S, MAX_LOGIT_BIAS]
    presence_penalty: StepArray  # float32 [S]
    frequency_penalty: StepArray  # float32 [S]
    repetition_penalty: StepArray  # float32 [S]
    past_tokens: StepArray  # int32 [S, H]   each row's tokens by position, H = its most (pages_per_row x page_size):
    #                                the host fills those before the row's start, the step its new ones (vocab_size
    #                                elsewhere); counted by the penalties where a row has no slot in the device's
    #                                counts (`jaxserve.runner.penalty_slots`)
    prompt_len: StepArray  # int32 [S]   positions from this one on are generated tokens
    # The penalties' counts kept on device (`jaxserve.sample.penalty_counts`): each row's slot there (-1: none), and
    # whether the slot starts over from past_tokens (else past_tokens is not sent: the slot holds the row's tokens up
    # to its start already).
    penalty_slot: StepArray  # int32 [S]
    penalty_init: StepArray  # bool [S]
    # The device's PenaltyCounts, set inside a step program (None as the host sends it, and where the runner keeps
    # none: the penalties then count past_tokens, sent whole every step).
    penalty_state: Any = dataclasses.field(default=None, metadata={"device_only": True})  # never on a wire


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInput:
    token_ids: StepArray  # int32 [T]
    chain_slot: StepArray  # int32 [T]   >= 0: the token is last_tokens[chain_slot], sampled by the step before
    #                                     and still on device (token_ids holds a placeholder); -1: token_ids holds it
    slot_mapping: StepArray  # int32 [T]   flat cache slot (page * page_size + offset) each new K/V is written to
    rows: RaggedRows
    logits_index: StepArray  # int32 [S, Q]   the tokens whose logits each row samples from: its last, or its
    #                                        last num_draft + 1 in a verification program (Q = k + 1); -1: none
    num_draft: StepArray  # int32 [S]   proposals at the end of each row (speculative decoding), to accept or not
    out_slot: StepArray  # int32 [S]   where each row's sampled token is kept on device (-1: the padding slot)
    sampling: SamplingInput
    # Prompt logprobs: the prompt token after each token, whose logprob the step reports (-1: not wanted; a
    # `constant` when no row wants any, so a plain batch copies nothing for it).
    prompt_targets: StepArray  # int32 [T]
    # Whether a scored token's top MAX_LOGPROBS are wanted (its request's prompt_logprobs > 0): a block of tokens none
    # of which wants them skips the top-k over the vocabulary (a `constant` False when no row wants any).
    prompt_top: StepArray  # bool [T]
    # Multi-LoRA: each token's adapter slot in the runner's LoRA buffers (`jaxserve.lora`), -1 for the base model (a
    # `constant` when no row has an adapter).
    lora_slot: StepArray  # int32 [T]
    # Whether the step samples its rows (a `constant` True; False: the first half of a split step, whose rows sample
    # once the host has filled their grammar masks: `jaxserve.runner.steps.Steps.sample_joined`).
    sample_rows: StepArray  # bool []

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.logits_index.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptScores:
    """The logprobs of the tokens a step was asked to score (`StepInput.prompt_targets`), packed: entry i is the
    i-th token, in token order, whose target is >= 0; entries past their number are padding."""
    logprobs: jax.Array  # float32 [T]   of the target under the model's distribution at that token
    ranks: jax.Array  # int32 [T]   the target's rank (1: the most likely token)
    top_ids: jax.Array  # int32 [T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # float32 [T, MAX_LOGPROBS]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """Up to Q sampled tokens per row (Q = k + 1 in a verification program): a row emits num_tokens[r] of them."""
    tokens: jax.Array  # int32 [S, Q]
    num_tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # float32 [S, Q]   of each token under the model's distribution
    ranks: jax.Array  # int32 [S, Q]   1: the most likely token
    # Zeros unless a row asked for top logprobs; None once the runner drops them from a step where none did.
    top_ids: jax.Array | None  # int32 [S, Q, MAX_LOGPROBS]
    top_logprobs: jax.Array | None  # float32 [S, Q, MAX_LOGPROBS]
    prompt: PromptScores | None = None  # per scored prompt token, not per row (None: no row asked)


@functools.cache
def constant(shape: tuple[int, ...], dtype, fill) -> np.ndarray:
    """A read-only array a batch holds in place of a per-row array no row uses (no row has a token mask, say):
    `jaxserve.runner.steps.Steps.put_batch` keeps one device copy of each, so such a batch copies nothing for it."""
    a = np.full(shape, fill, dtype)
    a.flags.writeable = False
    _constants[id(a)] = a  # held for good (by the cache too), so an id is never reused
    return a


_constants: dict[int, np.ndarray] = {}


def is_constant(x) -> bool:
    return _constants.get(id(x)) is x
