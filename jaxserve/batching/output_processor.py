"""From sampled tokens to what a request says: detokenizing, stop rules, logprobs, and the deltas streamed.

The output processor is the one writer of each sequence's `OutputState`. It reads a step's result row by row,
takes each row's tokens up to the first that ends the sequence (EOS, a stop id, a stop string, a length limit),
and says so; the scheduler then applies the tokens it took (`Scheduler.update`). Text that could still grow into
a stop string is held back until it cannot (or the sequence ends), so no part of a stop string is ever shown, as
in OpenAI's and vLLM's APIs.

Under a grammar (structured output) each token taken advances the sequence's matcher, and the token that completes
the grammar ends the sequence ("stop"); stop strings, EOS and max_tokens end it as they would any other (max_tokens
may cut the output short of the grammar's end, as in OpenAI's API). A grammar that starts after a reasoning model's
end tag (`GrammarGate`) is neither advanced nor masked before the tag's last token.

A sequence that cannot go on within its constraints ends with finish reason "error" (vLLM's FinishReason.ERROR):
a row whose masks and bans left no token (the device's NO_TOKEN, nothing taken), a grammar that failed, and a
grammar complete before min_tokens (it allows only EOS, which min_tokens bans). Never a token outside the mask: a
token the grammar refuses is not taken (no text, count or logprob of it).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import logging

from jaxserve.batch import PromptScores, StepOutput
from jaxserve.batching.sequence import Sequence
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics
from jaxserve.runner.batch_builder import Row
from jaxserve.sample.sampling import NO_TOKEN

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class SequenceDelta:
    """One sequence's part of a step's result: the tokens it took, and what is new for its request."""
    seq: Sequence
    num_emitted: int  # tokens the step emitted for it (a verification row: accepted proposals + 1)
    completion: CompletionOutput  # new text, the tokens taken (up to any stop), their logprobs; why it ended

    @property
    def token_ids(self) -> list[int]:
        return self.completion.token_ids

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None


def process(rows: list[Sequence], result: StepOutput,
            layout: collections.abc.Sequence[Row] = ()) -> list[SequenceDelta]:
    """A step's result, rows in the order the scheduler laid them out (`layout`: the rows themselves, which say
    which prompt positions the step scored); rows that emitted nothing (a prompt chunk short of its end) and
    sequences finished or aborted while the step ran are skipped."""
    if result.prompt is not None:
        _take_prompt_scores(rows, layout, result.prompt)
    tokens, counts = result.tokens.tolist(), result.num_tokens.tolist()
    deltas = []
    for i, seq in enumerate(rows):
        if not counts[i] or seq.finished:
            continue
        out = seq.output
        if seq.params.max_tokens == 0:  # a prompt scored without generating: the sampled token is dropped
            out.finish_reason = "length"
            deltas.append(SequenceDelta(seq, counts[i], completion_output(seq, "", [], [] if out.logprobs is not None
                                                                          else None)))
            continue
        start_logprobs = len(out.logprobs) if out.logprobs is not None else 0
        taken = []
        for j in range(counts[i]):
            if tokens[i][j] == NO_TOKEN:
                _end_without_token(seq)
                break
            top = []
            if seq.params.logprobs:
                # The runner drops the top logprobs only from a step where no row asked for them.
                assert result.top_ids is not None and result.top_logprobs is not None
                top = list(zip(result.top_ids[i, j].tolist(), result.top_logprobs[i, j].tolist()))
            if _take_token(seq, tokens[i][j], float(result.logprobs[i, j]), int(result.ranks[i, j]), top):
                taken.append(tokens[i][j])
            if out.finish_reason is not None:
                break  # never a token past a stop
        new_logprobs = out.logprobs[start_logprobs:] if out.logprobs is not None else None
        deltas.append(SequenceDelta(seq, counts[i], completion_output(seq, _release(seq), taken, new_logprobs)))
    return deltas


def take_as_said(seq: Sequence, token_id: int, logprob: float = 0.0) -> None:
    """A first token sampled and streamed elsewhere (by a prefill server): taken as this sequence's first, its text
    counted as sent (less any tail held back there as the start of a stop string, held back here alike), so what
    is streamed here starts after it. Raises ValueError if it ends the sequence: then nothing is left to decode."""
    _take_token(seq, token_id, logprob, 1, [])
    _release(seq)
    if seq.output.finish_reason is not None:
        raise ValueError(f"request {seq.request_id}: its first token ({token_id}) ends it; nothing to decode")


def completion_output(seq: Sequence, text: str | None = None, token_ids: list[int] | None = None,
                      logprobs: list[dict[int, Logprob]] | None = None) -> CompletionOutput:
    """The one place a CompletionOutput is made: the whole output so far (no arguments), or a delta."""
    out = seq.output
    return CompletionOutput(seq.index, out.text if text is None else text,
                            list(seq.output_token_ids) if token_ids is None else token_ids,
                            out.cumulative_logprob if out.logprobs is not None else None,
                            out.logprobs if logprobs is None else logprobs, out.finish_reason, out.stop_reason)


def request_metrics(seqs: list[Sequence]) -> RequestMetrics:
    """One request's timestamps, over its n sequences: the first start and first token, the last finish."""
    def first(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None
    finished = [s.finish_time for s in seqs if s.finish_time is not None]
    return RequestMetrics(seqs[0].arrival_time, first(s.first_scheduled_time for s in seqs),
                          first(s.first_token_time for s in seqs),
                          max(finished) if len(finished) == len(seqs) else None, sum(s.num_preemptions for s in seqs))


def cached_prompt_tokens(seqs: list[Sequence]) -> int | None:
    """A request's prompt tokens served from the prefix cache (vLLM's RequestOutput.num_cached_tokens): the fewest
    any of its n sequences found, which are the tokens none of them computed (the prompt counts once in usage, as
    prompt_tokens does; a sibling admitted after the first finds the first's pages, not the request's own hits).
    None before any of them is admitted."""
    found = [s.num_cached_prompt_tokens for s in seqs if s.num_cached_prompt_tokens is not None]
    return min(found) if found else None


def _take_token(seq: Sequence, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> bool:
    """Takes a token into the sequence's output; False if its grammar refused it (or failed on it): then nothing
    of it is kept (text, count, logprobs), and the sequence ends with an error after the tokens before it."""
    out, params, rules = seq.output, seq.params, seq.stop_rules
    grammar = _advance_grammar(seq, token) if out.grammar is not None and out.gate is None else None
    if out.gate is not None and out.gate.passes(token):  # the reasoning's end tag: the grammar applies from here
        out.gate = None
    if grammar == FAILED:
        out.finish_reason, out.stop_reason = "error", None
        return False
    out.num_tokens += 1
    out.cumulative_logprob += logprob
    if out.logprobs is not None:
        entry = {tid: Logprob(lp, r + 1, _piece(out, tid)) for r, (tid, lp) in enumerate(top[:params.logprobs])}
        entry.setdefault(token, Logprob(logprob, rank, _piece(out, token)))
        out.logprobs.append(entry)
    piece = out.detokenizer.add(token) if out.detokenizer is not None else ""
    n = out.num_tokens
    if n >= params.min_tokens and (token in rules.eos or token in rules.stop_ids):
        # The ending token's text is not part of the output unless asked, as in vLLM.
        out.finish_reason, out.stop_reason = "stop", None if token in rules.eos else token
        if params.include_stop_str_in_output:
            out.text += piece
        return True
    out.text += piece
    if piece and rules.strings and n >= params.min_tokens:
        _check_stop_strings(seq, len(out.text) - len(piece))
        if out.finish_reason:
            return True
    if grammar == COMPLETE:
        # Short of min_tokens the grammar allows only EOS, which min_tokens bans: nothing can follow.
        out.finish_reason, out.stop_reason = "stop" if n >= params.min_tokens else "error", None
        if n < params.min_tokens:
            logger.warning("request %s: its grammar is complete after %d of min_tokens %d; the sequence ends with "
                           "an error", seq.request_id, n, params.min_tokens)
        return True
    if n >= (seq.max_model_len if params.max_tokens is None else params.max_tokens) or \
            len(seq.prompt_token_ids) + n >= seq.max_model_len:
        out.finish_reason = "length"
    return True


COMPLETE, FAILED = "complete", "failed"


def _advance_grammar(seq: Sequence, token: int) -> str | None:
    """Moves the sequence's grammar past its new token: COMPLETE, FAILED (which its masks cannot let happen but for
    a per-step limit of llguidance's), or None while it goes on."""
    grammar = seq.output.grammar
    assert grammar is not None  # called only for a sequence under a grammar
    if grammar.accept(token) and not grammar.failed:
        return COMPLETE if grammar.is_terminated else None
    logger.warning("request %s: its grammar failed (%s); the sequence ends with an error", seq.request_id,
                   grammar.error_line)
    return FAILED


def _end_without_token(seq: Sequence) -> None:
    """A row that had no token to sample (NO_TOKEN): the sequence ends with an error, taking nothing."""
    grammar = seq.output.grammar
    why = f"its grammar failed ({grammar.error_line})" if grammar is not None and grammar.failed else \
        "its grammar, allowed_token_ids, bad_words and min_tokens left no token to sample"
    logger.warning("request %s: %s; the sequence ends with an error", seq.request_id, why)
    seq.output.finish_reason, seq.output.stop_reason = "error", None


def free_grammar(seq: Sequence) -> None:
    """A sequence taken out (finished or aborted) lets its matcher go now, not when its request is dropped."""
    seq.output.grammar = None


def _take_prompt_scores(rows: list[Sequence], layout: collections.abc.Sequence[Row], scores: PromptScores) -> None:
    """Appends the prompt positions each row's chunk scored to its sequence's prompt logprobs. The scores are packed
    in the rows' order; a position already collected (a chunk recomputed after a preemption) is not taken twice."""
    k = 0
    for seq, row in zip(rows, layout):
        n, collected, top = len(row.prompt_targets), seq.output.prompt_logprobs, seq.params.prompt_logprobs
        if n and collected is not None:
            lps, ranks = scores.logprobs[k:k + n].tolist(), scores.ranks[k:k + n].tolist()
            top_ids, top_lps = scores.top_ids[k:k + n, :top].tolist(), scores.top_logprobs[k:k + n, :top].tolist()
            for j, position in enumerate(row.scored_positions):
                if len(collected) != position + 1:
                    continue
                target = row.prompt_targets[j]
                entry = {target: Logprob(lps[j], ranks[j], _piece(seq.output, target))}
                for rank, (tid, lp) in enumerate(zip(top_ids[j], top_lps[j]), 1):
                    entry.setdefault(tid, Logprob(lp, rank, _piece(seq.output, tid)))
                collected.append(entry)
        k += n


def _check_stop_strings(seq: Sequence, old_len: int) -> None:
    """Ends the text at the first stop string that the text since old_len completed."""
    out, params = seq.output, seq.params
    # A match must end in the new text: one wholly before it was written under min_tokens, and stays (as vLLM).
    hits = [(at, s) for s in seq.stop_rules.strings if (at := out.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
    if hits:
        at, stop = min(hits)
        out.text = out.text[:at + (len(stop) if params.include_stop_str_in_output else 0)]
        out.finish_reason, out.stop_reason = "stop", stop


def _stop_prefix_length(seq: Sequence) -> int:
    """Characters at the end of the text that are the start of some stop string (0 if none)."""
    out, rules = seq.output, seq.stop_rules
    text = out.text
    for p in range(max(out.sent, len(text) - rules.longest_stop + 1), len(text)):
        # Most positions fail the first-character test: a stop string's prefix is looked for only where one
        # could start, so the host's per-token work stays small.
        if text[p] in rules.stop_firsts:
            tail = text[p:]
            if any(s.startswith(tail) for s in rules.strings):
                return len(text) - p
    return 0


def _release(seq: Sequence) -> str:
    """The text not yet streamed, but for a tail that could still become a stop string (none once it ended)."""
    out = seq.output
    hold = 0 if out.finish_reason is not None else _stop_prefix_length(seq)
    end = len(out.text) - hold
    delta = out.text[out.sent:end]
    out.sent = max(out.sent, end)
    return delta


def _piece(out, token_id: int) -> str | None:
    return out.detokenizer.tokenizer.decode([token_id], skip_special_tokens=False) if out.detokenizer else None
