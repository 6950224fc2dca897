"""One generated sequence: its tokens, its pages, and the rules that end it."""
from __future__ import annotations

import enum
import itertools
import time

from jaxserve.batching.batch_builder import RowSampling
from jaxserve.outputs import CompletionOutput, Logprob
from jaxserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenIds:
    """prompt + output as one sliceable sequence, without copying either per step."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, _ = s.indices(len(self))
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]


_arrivals = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_model_len: int, eos_token_ids: list[int], detokenizer=None, priority: int = 0):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = TokenIds(self.prompt_token_ids, self.output_token_ids)
        self.priority = priority  # lower runs first, as in vLLM
        self.boost = 0  # earned by waiting: subtracted from priority, so no request starves
        self.arrival = next(_arrivals)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.waited_steps = 0
        self.params = params
        self.seed = seed
        self.max_model_len = max_model_len
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        # Sets: every generated token is looked up in them.
        self._eos, self._stop_ids = frozenset(self.eos_token_ids), frozenset(params.stop_token_ids)
        # What min_tokens bans on device, each id once: EOS and stop ids.
        self.ending_token_ids = tuple(dict.fromkeys(self.eos_token_ids + params.stop_token_ids))
        self._longest_stop = max(map(len, params.stop), default=0)
        self._stop_firsts = frozenset(s[0] for s in params.stop)
        self.detokenizer = detokenizer
        self.pages: list[int] = []
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages (see jaxserve.cache.page_keys)
        self.num_published = 0  # of its pages, how many the prefix cache has been told about
        self.num_cached = 0  # tokens whose K/V are in the cache, or written by a step already dispatched
        self.num_written = 0  # of those, tokens written by steps that have completed
        self.num_draft_cached = 0  # tokens whose K/V a draft model has in its own cache (same pages)
        self.pending = 0  # rows sampled by a dispatched step and not yet read back (0 or 1)
        self.slot: int | None = None  # its row in the device-side buffer of last sampled tokens, while running
        self.status = Status.WAITING
        self.text = ""  # all of it, including what is held back from the stream
        self._sent = 0  # characters of text already returned by append_token
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        """Tokens so far, counting one still in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + self.pending

    @property
    def effective_priority(self) -> tuple[int, int]:
        return (self.priority - self.boost, self.arrival)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence can reach: what its pages must hold."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(limit, len(self.prompt_token_ids) + self.params.max_tokens)
        return limit

    @property
    def num_to_compute(self) -> int:
        """Tokens whose K/V the next steps must compute: one while decoding, more in (re)prefill."""
        return self.num_tokens - self.num_cached

    @property
    def reached_length_limit(self) -> bool:
        """Ends at length once the in-flight token lands: nothing more to schedule."""
        limit = self.params.max_tokens or self.max_model_len
        return self.num_generated >= limit or self.num_tokens >= self.max_model_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sampling_row(self) -> RowSampling:
        p = self.params
        # min_tokens: until reached, ending tokens may not be sampled at all (a device-side ban, as in vLLM; the
        # device counts, since one verification row samples several tokens).
        banned = self.ending_token_ids if self.num_generated < p.min_tokens else ()
        return RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=self.seed,
                           step=self.num_generated, banned=banned, min_tokens=p.min_tokens,
                           want_top_logprobs=bool(p.logprobs))

    def append_token(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> str:
        """Adds a sampled token, checks every stop rule, and returns the new text to show.

        Text that could still grow into a stop string is held back until it cannot (or the sequence ends), so no
        part of a stop string is ever shown, as in OpenAI's and vLLM's APIs.
        """
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {tid: Logprob(lp, r + 1, self._piece(tid)) for r, (tid, lp) in enumerate(top[:self.params.logprobs])}
            entry.setdefault(token, Logprob(logprob, rank, self._piece(token)))
            self.logprobs.append(entry)
        piece = self.detokenizer.add(token) if self.detokenizer is not None else ""
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens and (token in self._eos or token in self._stop_ids):
            # The ending token's text is not part of the output unless asked, as in vLLM.
            self.finish_reason, self.stop_reason = "stop", None if token in self._eos else token
            if self.params.include_stop_str_in_output:
                self.text += piece
            return self._release(0)
        self.text += piece
        if piece and self.params.stop and n_out >= self.params.min_tokens:
            self._check_stop_strings(len(self.text) - len(piece))
            if self.finish_reason:
                return self._release(0)
        if n_out >= (self.params.max_tokens or self.max_model_len) or \
                len(self.prompt_token_ids) + n_out >= self.max_model_len:
            self.finish_reason = "length"
            return self._release(0)
        return self._release(self._stop_prefix_length())

    def _check_stop_strings(self, old_len: int) -> None:
        """Ends the text at the first stop string that the text since old_len completed."""
        # A match must end in the new text: one wholly before it was written under min_tokens, and stays (as vLLM).
        hits = [(at, s) for s in self.params.stop if (at := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[:at + (len(stop) if self.params.include_stop_str_in_output else 0)]
            self.finish_reason, self.stop_reason = "stop", stop

    def _stop_prefix_length(self) -> int:
        """Characters at the end of the text that are the start of some stop string (0 if none)."""
        text, stops = self.text, self.params.stop
        for p in range(max(self._sent, len(text) - self._longest_stop + 1), len(text)):
            # Most positions fail the first-character test: a stop string's prefix is looked for only where one
            # could start, so the host's per-token work stays small.
            if text[p] in self._stop_firsts:
                tail = text[p:]
                if any(s.startswith(tail) for s in stops):
                    return len(text) - p
        return 0

    def _release(self, hold: int) -> str:
        """The text not yet shown, but for the last `hold` characters."""
        end = len(self.text) - hold
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

    def _piece(self, token_id: int) -> str | None:
        return self.detokenizer.tokenizer.decode([token_id], skip_special_tokens=False) if self.detokenizer else None

    def completion_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.output_token_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                self.logprobs, self.finish_reason, self.stop_reason)
