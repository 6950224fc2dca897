"""The one place where a step's rows become its device arrays: numpy, padded to a bucket, copied to the
device in one go (see `jaxserve.batch` for the layout)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.batch import RaggedRows, SamplingInput, StepInput, constant
from jaxserve.cache import SCRATCH_PAGE, pages_needed
from jaxserve.sample.token_mask import num_words
from jaxserve.sampling_params import MAX_BAD_WORD_BANS, MAX_BANNED_TOKENS, MAX_LOGIT_BIAS


@dataclasses.dataclass
class RowSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0
    banned: tuple[int, ...] = ()  # while fewer than min_tokens are generated
    min_tokens: int = 0
    want_top_logprobs: bool = False
    # int32 [ceil(V / 32)] (`jaxserve.sample.token_mask`); None: every token allowed
    token_mask: np.ndarray | None = None
    # Logit controls (`jaxserve.sample.logit_controls`, SamplingParams): bad words' (trigger, banned) pairs,
    # logit_bias as (ids int32 [n], biases float32 [n]), the penalties, and what they count: the sequence's tokens
    # (int32, at least those before the row's start; None where no penalty is asked) and its prompt's length.
    bad_word_bans: tuple[tuple[int, int], ...] = ()
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    past_tokens: np.ndarray | None = None
    prompt_len: int = 0
    # The row's slot of the device's penalty counts (-1: none), and whether it starts over from past_tokens (set by
    # the runner, `jaxserve.runner.penalty_slots`; without init a step sends no history).
    penalty_slot: int = -1
    penalty_init: bool = False


@dataclasses.dataclass
class Row:
    """One sequence's part of a step."""
    token_ids: list[int]  # new tokens this step
    start_pos: int  # tokens of this sequence already in the cache
    pages: list[int]  # its pages, covering at least start_pos + len(token_ids) tokens
    sampling: RowSampling = dataclasses.field(default_factory=RowSampling)
    slot: int = -1  # where the device keeps the token this row samples (-1: the padding slot)
    chained: bool = False  # token_ids[0] is a placeholder for the token last sampled into `slot`, still on device
    samples: bool = True  # the step samples the row's next token (not for a prompt chunk short of the prompt's end)
    num_draft: int = 0  # the last num_draft tokens are proposals (speculative decoding): the step scores each
    # Prompt logprobs: the step reports the logprob of prompt_targets[i] at the row's token score_from + i (the
    # prompt token after it).
    prompt_targets: list[int] = dataclasses.field(default_factory=list)
    score_from: int = 0
    prompt_top: bool = False  # the step also reports each scored position's top MAX_LOGPROBS
    lora_slot: int = -1  # the device slot of the row's LoRA adapter (-1: the base model)

    @property
    def end(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def scored_positions(self) -> range:
        """The positions whose next prompt token the step scores."""
        start = self.start_pos + self.score_from
        return range(start, start + len(self.prompt_targets))


def neutral_sampling(num_rows: int, vocab_size: int, max_len: int = 1) -> SamplingInput:
    """Sampling arrays for num_rows rows that ask for nothing (greedy, no filter, ban, mask, bias or penalty), rows of
    up to max_len tokens: padding rows, and what build_batch fills a row's parameters into."""
    S, V = num_rows, vocab_size
    return SamplingInput(
        temperature=np.zeros(S, np.float32), top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
        min_p=np.zeros(S, np.float32), seed=np.zeros(S, np.uint32), step=np.zeros(S, np.int32),
        min_tokens=np.zeros(S, np.int32), banned=np.full((S, MAX_BANNED_TOKENS), V, np.int32),
        want_top_logprobs=np.zeros(S, bool), token_mask=constant((S, num_words(V)), np.int32, -1),
        bad_word_bans=constant((S, MAX_BAD_WORD_BANS, 2), np.int32, V),
        logit_bias_ids=constant((S, MAX_LOGIT_BIAS), np.int32, V),
        logit_bias=constant((S, MAX_LOGIT_BIAS), np.float32, 0),
        presence_penalty=np.zeros(S, np.float32), frequency_penalty=np.zeros(S, np.float32),
        repetition_penalty=np.ones(S, np.float32), past_tokens=constant((S, max_len), np.int32, V),
        prompt_len=np.zeros(S, np.int32), penalty_slot=np.full(S, -1, np.int32), penalty_init=np.zeros(S, bool))


# SamplingInput's per-row arrays that stay a `constant` unless a row uses them, and how a RowSampling uses them.
_USED = {
    "token_mask": lambda s: s.token_mask is not None,
    "bad_word_bans": lambda s: bool(s.bad_word_bans),
    "logit_bias_ids": lambda s: s.logit_bias is not None,
    "logit_bias": lambda s: s.logit_bias is not None,
    "past_tokens": lambda s: s.past_tokens is not None,
}


# RowSampling's fields that SamplingInput holds as they are, one entry per row.
_SCALARS = ("temperature", "top_k", "top_p", "min_p", "seed", "step", "min_tokens", "want_top_logprobs",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_len", "penalty_slot",
            "penalty_init")


def build_batch(rows: list[Row], page_size: int, vocab_size: int, num_tokens: int, num_rows: int,
                pages_per_row: int, num_scored: int = 1, sample_rows: bool = True) -> StepInput:
    """Lays `rows` back to back in `num_tokens` tokens, with `num_rows` rows and a [num_rows, pages_per_row] table;
    each row scores up to `num_scored` tokens (1, or k + 1 for a verification program). sample_rows False: the
    first half of a split step (`StepInput.sample_rows`)."""
    total = _check_sizes(rows, num_tokens, num_rows)
    batch = _padded_batch(rows, page_size, vocab_size, num_tokens, num_rows, pages_per_row, num_scored, total)
    batch.sample_rows = constant((), bool, sample_rows)
    t = 0  # the row's first token in the batch
    for i, row in enumerate(rows):
        _place_tokens(batch, i, row, t, page_size)
        _place_scoring(batch, i, row, t)
        _fill_sampling(batch.sampling, i, row)
        t += len(row.token_ids)
    return batch


def _check_sizes(rows: list[Row], num_tokens: int, num_rows: int) -> int:
    """The rows' tokens in all, which must fit the batch, as the rows must."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {num_rows}")
    total = sum(len(r.token_ids) for r in rows)
    if total > num_tokens:
        raise ValueError(f"{total} tokens do not fit a batch of {num_tokens}")
    return total


def _padded_batch(rows: list[Row], page_size: int, vocab_size: int, num_tokens: int, num_rows: int,
                  pages_per_row: int, num_scored: int, total: int) -> StepInput:
    """The batch before any row is placed: every token and row padding, which writes to the scratch page, reads
    nothing through its table and samples nothing. A per-row array that none of `rows` uses stays a `constant`
    (copied to the device once for all batches); the others are writeable, for the rows to fill."""
    T, S, P, Q = num_tokens, num_rows, pages_per_row, num_scored
    sampling = neutral_sampling(S, vocab_size, P * page_size)
    for name, used in _USED.items():
        if any(used(r.sampling) for r in rows):
            setattr(sampling, name, np.array(getattr(sampling, name)))  # a writeable copy
    prompt_targets = constant((T,), np.int32, -1)
    if any(r.prompt_targets for r in rows):
        prompt_targets = np.full(T, -1, np.int32)
    prompt_top = constant((T,), bool, False)
    if any(r.prompt_targets and r.prompt_top for r in rows):
        prompt_top = np.zeros(T, bool)
    lora_slot = constant((T,), np.int32, -1)
    if any(r.lora_slot >= 0 for r in rows):
        lora_slot = np.full(T, -1, np.int32)
    # Padding writes land in the scratch page, spread over its slots.
    slot_mapping = SCRATCH_PAGE * page_size + np.arange(T, dtype=np.int32) % page_size
    # Padding rows start where the real tokens end, so they hold none.
    rows_in = RaggedRows(positions=np.full(T, -1, np.int32), token_row=np.zeros(T, np.int32),
                         query_start=np.full(S + 1, total, np.int32), cached_lens=np.zeros(S, np.int32),
                         page_table=np.full((S, P), SCRATCH_PAGE, np.int32))
    return StepInput(token_ids=np.zeros(T, np.int32), chain_slot=np.full(T, -1, np.int32), slot_mapping=slot_mapping,
                     rows=rows_in, logits_index=np.full((S, Q), -1, np.int32), num_draft=np.zeros(S, np.int32),
                     out_slot=np.full(S, -1, np.int32), sampling=sampling, prompt_targets=prompt_targets,
                     prompt_top=prompt_top, lora_slot=lora_slot, sample_rows=constant((), bool, True))


def _place_tokens(batch: StepInput, i: int, row: Row, t: int, page_size: int) -> None:
    """Row i's tokens at batch tokens [t, t + n): their ids (or the device slot the first is chained from), their
    positions, the cache slots their K/V go to, their adapter, and the row's cached pages in its table."""
    n, end = len(row.token_ids), row.end
    if n < 1:
        raise ValueError(f"row {i} has no new tokens")
    if len(row.pages) * page_size < end:
        raise ValueError(f"row {i}: {len(row.pages)} pages cannot hold {end} tokens")
    # The table lists only the pages of tokens cached before this step: the new tokens' keys reach attention
    # directly, so a fresh prompt attends through an empty table.
    cached = row.pages[:pages_needed(row.start_pos, page_size)]
    P = batch.rows.page_table.shape[1]
    if len(cached) > P:
        raise ValueError(f"row {i}: {row.start_pos} cached tokens need {len(cached)} pages, the table holds {P}")
    pos = np.arange(row.start_pos, end, dtype=np.int32)  # [n]
    pages = np.asarray(row.pages, np.int32)
    batch.token_ids[t:t + n] = row.token_ids
    batch.rows.positions[t:t + n] = pos
    batch.slot_mapping[t:t + n] = pages[pos // page_size] * page_size + pos % page_size
    batch.rows.token_row[t:t + n] = i
    batch.rows.query_start[i] = t
    batch.rows.cached_lens[i] = row.start_pos
    batch.rows.page_table[i, :len(cached)] = cached
    if row.chained:
        batch.chain_slot[t] = row.slot
    if row.lora_slot >= 0:
        # int32 [T]; named apart from Sequence.lora_slot (tests/batching/test_state_owners.py)
        token_adapter = batch.lora_slot
        token_adapter[t:t + n] = row.lora_slot


def _place_scoring(batch: StepInput, i: int, row: Row, t: int) -> None:
    """What row i's step reads out: the logits it samples from (its last token, or its proposals' and the one
    before them), where its sample is kept, and the prompt tokens it scores."""
    n, Q = len(row.token_ids), batch.logits_index.shape[1]
    if not 0 <= row.num_draft < min(n, Q):
        raise ValueError(f"row {i}: {row.num_draft} proposals in {n} tokens; a row scores at most {Q}")
    if row.samples:
        batch.logits_index[i, :row.num_draft + 1] = np.arange(t + n - 1 - row.num_draft, t + n)
        batch.num_draft[i] = row.num_draft
        batch.out_slot[i] = row.slot
    if row.prompt_targets:
        if not 0 <= row.score_from <= n - len(row.prompt_targets):
            raise ValueError(f"row {i}: {len(row.prompt_targets)} prompt targets from token {row.score_from} "
                             f"of {n}")
        start = t + row.score_from
        batch.prompt_targets[start:start + len(row.prompt_targets)] = row.prompt_targets
        if row.prompt_top:
            batch.prompt_top[start:start + len(row.prompt_targets)] = True


def _fill_sampling(sampling: SamplingInput, i: int, row: Row) -> None:
    """Row i's sampling parameters, bans, mask and logit controls."""
    s = row.sampling
    if len(s.banned) > MAX_BANNED_TOKENS:  # refused at admission (see LLM._sequences): a bug if it gets here
        raise ValueError(f"row {i} bans {len(s.banned)} tokens; a row holds at most {MAX_BANNED_TOKENS}")
    for key in _SCALARS:
        getattr(sampling, key)[i] = getattr(s, key)
    sampling.banned[i, :len(s.banned)] = s.banned
    if s.token_mask is not None:
        sampling.token_mask[i] = s.token_mask
    _fill_logit_controls(sampling, i, row)


def _fill_logit_controls(sampling: SamplingInput, i: int, row: Row) -> None:
    s = row.sampling
    # More than these is refused at admission (SamplingParams, jaxserve.sample.logit_controls): a bug if it gets here.
    if len(s.bad_word_bans) > MAX_BAD_WORD_BANS:
        raise ValueError(f"row {i} has {len(s.bad_word_bans)} bad-word bans; a row holds {MAX_BAD_WORD_BANS}")
    if s.bad_word_bans:
        sampling.bad_word_bans[i, :len(s.bad_word_bans)] = s.bad_word_bans
    if s.logit_bias is not None:
        ids, biases = s.logit_bias
        if len(ids) > MAX_LOGIT_BIAS:
            raise ValueError(f"row {i} has {len(ids)} logit_bias entries; a row holds {MAX_LOGIT_BIAS}")
        sampling.logit_bias_ids[i, :len(ids)] = ids
        sampling.logit_bias[i, :len(ids)] = biases
    if s.past_tokens is not None:
        sampling.past_tokens[i, :row.start_pos] = s.past_tokens[:row.start_pos]


def warmup_rows(tokens: int, num_rows: int, num_draft: int, page_size: int) -> list[Row]:
    """Rows of a warm-up step: tokens spread over num_rows (the first with num_draft proposals), every page the
    scratch page: the bucket's real shapes, no cache content touched."""
    per_row, extra = divmod(tokens, num_rows)
    lengths = [per_row + (i < extra) for i in range(num_rows)]
    if num_draft and lengths[0] == 1:  # a verification row needs a proposal after its token
        lengths = [2] + lengths[1:-1]
    drafts = [min(num_draft, lengths[0] - 1)] + [0] * (len(lengths) - 1)
    return [Row([0] * n, 0, [0] * pages_needed(n + 1, page_size), num_draft=d) for n, d in zip(lengths, drafts)]
