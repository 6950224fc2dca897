"""A planned step as the runner's rows (`jaxserve.runner.batch_builder.Row`): each row's tokens, pages and how it
samples, read from its sequence as it stands before the step is counted in; then the grammar masks of the rows that
sample under one, filled all at once. Reads sequences, never writes them (the scheduler does).
"""
from __future__ import annotations

import numpy as np

from jaxserve.batching.sequence import Sequence
from jaxserve.batching.step_plan import Chunk, ScheduledBatch
from jaxserve.runner.batch_builder import Row, RowSampling
from jaxserve.sample.logit_controls import bad_word_bans
from jaxserve.sample.token_mask import both
from jaxserve.structured_output import fill_masks


def prompt_targets(chunk: Chunk) -> dict:
    """A prompt chunk's Row arguments for prompt logprobs: each position from the first not yet collected (a
    recomputed chunk asks only for what is missing) scores the prompt token after it; the last prompt token has
    none. Empty when the sequence does not score its prompt."""
    seq = chunk.seq
    collected = seq.output.prompt_logprobs
    if collected is None or not seq.scores_prompt:
        return {}
    prompt = seq.prompt_token_ids
    first = max(chunk.start, len(collected) - 1)
    end = min(chunk.start + chunk.length, len(prompt) - 1)
    if first >= end:
        return {}
    return dict(prompt_targets=prompt[first + 1:end + 1], score_from=first - chunk.start,
                prompt_top=bool(seq.params.prompt_logprobs))


def row_sampling(seq: Sequence, ahead: int = 0, top_logprobs: bool = True) -> RowSampling:
    """How a row of `seq` samples its next token, or (a draft model's row) the token `ahead` tokens later: with its
    seed and generated token number, so a draft's draw is coupled with the target's. top_logprobs=False: a row whose
    logprobs nobody reads (a draft's)."""
    p = seq.params
    # min_tokens: until reached, ending tokens may not be sampled at all (a device-side ban, as in vLLM; the
    # device counts, since one verification row samples several tokens).
    banned = seq.ending_token_ids if seq.num_generated < p.min_tokens else ()
    c = seq.controls
    bans = bad_word_bans(c.bad_words, seq.output_token_ids, seq.num_generated) if c.bad_words else ()
    return RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
                       step=seq.num_generated + ahead, banned=banned, min_tokens=p.min_tokens,
                       want_top_logprobs=bool(p.logprobs) and top_logprobs,
                       # Logit controls: the request's mask and bias (resolved at admission), the bad words the
                       # row's last token may complete, the penalties and the tokens they count.
                       token_mask=c.token_mask, bad_word_bans=bans, logit_bias=c.logit_bias,
                       presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                       repetition_penalty=p.repetition_penalty, past_tokens=seq.token_ids_array,
                       prompt_len=len(seq.prompt_token_ids),
                       # where the device counts the row's tokens (`jaxserve.runner.penalty_slots`)
                       penalty_slot=-1 if seq.token_ids_array is None or seq.slot is None else seq.slot)


def lay_out_rows(plan: ScheduledBatch) -> list[Row]:
    """The batch as rows, from the sequences as they stand before it is counted in: decode rows (whose token the
    step before sampled is taken straight from the device), then prompt chunks."""
    rows = []
    for s in plan.decode:
        proposals = plan.proposals.get(s, [])
        rows.append(Row([0 if s.pending else s.last_token] + proposals, s.num_tokens - 1, s.pages,
                        row_sampling(s), _slot(s), chained=bool(s.pending), num_draft=len(proposals),
                        lora_slot=s.lora_slot))
    rows += [Row(c.seq.token_ids[c.start:c.start + c.length], c.start, c.seq.pages, row_sampling(c.seq),
                 _slot(c.seq) if c.is_last else -1, samples=c.is_last, lora_slot=c.seq.lora_slot,
                 **prompt_targets(c))
             for c in plan.prefill]
    return rows


def _slot(seq: Sequence) -> int:
    """Its slot in the device's buffer of sampled tokens: a sequence in a step is running, so it has one."""
    assert seq.slot is not None, f"request {seq.request_id} is in a step but holds no slot"
    return seq.slot


def constrain(plan: ScheduledBatch) -> None:
    """Fills the masks of the rows that sample under a grammar, all at once (llguidance's threads, without the
    GIL), each ANDed with any mask the row has already. A mask that allows nothing is sent as it is: the device
    sees it with the row's other bans and answers NO_TOKEN (`jaxserve.sample.sampling`). A row whose grammar waits
    for a reasoning end tag samples unmasked, but the plan counts as constrained all the same: this step's token
    may be the tag's last, after which the next step's mask needs it. A row whose input token is still in flight
    (chained) cannot have its mask yet: it is left for `masks_after_read_back` (`plan.masks_later`)."""
    under = [(row, seq) for row, seq in zip(plan.rows, plan.row_seqs)
             if row.samples and seq.output.grammar is not None]
    if under:
        plan.constrained = True
    plan.masks_later = [seq for row, seq in under if row.chained]
    constrained = [(row, seq.output.grammar) for row, seq in under
                   if not row.chained and seq.output.gate is None and seq.output.grammar is not None]
    if not constrained:
        return
    masks = fill_masks([grammar for _, grammar in constrained])  # [R, W]
    for (row, grammar), mask in zip(constrained, masks):
        row.sampling.token_mask = both(row.sampling.token_mask, _checked(grammar, mask))


def masks_after_read_back(plan: ScheduledBatch) -> np.ndarray | None:
    """The grammar masks of the rows `constrain` left for later, now that the step before is read back (each
    matcher stands after the token the row takes as input): int32 [rows, ceil(V / 32)], -1 (all allowed) for the
    other rows, for the device to AND with the rows' own masks; None: none to apply. A sequence that ended on that
    token (its row's token will be dropped) or whose grammar still waits for a reasoning end tag gets none."""
    index = {id(seq): i for i, seq in enumerate(plan.row_seqs)}
    due = [(index[id(seq)], seq.output.grammar) for seq in plan.masks_later
           if seq.output.gate is None and seq.output.grammar is not None]
    if not due:
        return None
    filled = fill_masks([grammar for _, grammar in due])  # [R, W]
    masks = np.full((len(plan.rows), filled.shape[1]), -1, np.int32)  # [rows, W]
    for (i, grammar), mask in zip(due, filled):
        masks[i] = _checked(grammar, mask)
    return masks


def _checked(grammar, mask: np.ndarray) -> np.ndarray:
    """A failed grammar's mask allows EOS, as a complete grammar's would: none instead, so it ends in error."""
    if grammar.failed:
        mask[:] = 0
    return mask
