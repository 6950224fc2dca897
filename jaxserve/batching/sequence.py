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
        self.detokenizer = detokenizer
        self.pages: list[int] = []
        self.page_keys: list[int] = []  # prefix-cache keys of its full pages (see jaxserve.cache.page_keys)
        self.num_published = 0  # of its pages, how many the prefix cache has been told about
        self.num_cached = 0  # tokens whose K/V are in the cache, or written by a step already dispatched
        self.pending = 0  # tokens sampled by a dispatched step and not yet read back (0 or 1)
        self.slot: int | None = None  # its row in the device-side buffer of last sampled tokens, while running
        self.status = Status.WAITING
        self.text = ""
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
        # min_tokens: until reached, ending tokens may not be sampled at all (a device-side ban, as in vLLM).
        banned = tuple(self.eos_token_ids + p.stop_token_ids) if self.num_generated < p.min_tokens else ()
        return RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=self.seed,
                           step=self.num_generated, banned=banned, want_top_logprobs=bool(p.logprobs))

    def append_token(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> str:
        """Adds a sampled token, checks every stop rule, and returns the new text to show."""
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {tid: Logprob(lp, r + 1, self._piece(tid)) for r, (tid, lp) in enumerate(top[:self.params.logprobs])}
            entry.setdefault(token, Logprob(logprob, rank, self._piece(token)))
            self.logprobs.append(entry)
        delta = self.detokenizer.add(token) if self.detokenizer is not None else ""
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if token in self.eos_token_ids:
                return self._finish("stop", None, delta)
            if token in self.params.stop_token_ids:
                return self._finish("stop", token, delta)
            if delta and self.params.stop:
                delta = self._check_stop_strings(delta)
                if self.finish_reason:
                    return delta
        self.text += delta
        if n_out >= (self.params.max_tokens or self.max_model_len) or \
                len(self.prompt_token_ids) + n_out >= self.max_model_len:
            self._finish("length", None, "")
        return delta

    def _check_stop_strings(self, delta: str) -> str:
        # Only the tail can hold a stop string that this token completed.
        longest = max(map(len, self.params.stop))
        start = max(0, len(self.text) - longest + 1)
        window = self.text[start:] + delta
        hits = [(window.find(s), s) for s in self.params.stop if s in window]
        if not hits:
            return delta
        at, stop = min(hits)
        end = at + (len(stop) if self.params.include_stop_str_in_output else 0)
        full = self.text[:start] + window[:end]
        new = full[len(self.text):]
        self.text = full
        self.finish_reason, self.stop_reason = "stop", stop
        return new

    def _finish(self, reason: str, stop_reason, delta: str) -> str:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if reason == "stop" and not self.params.include_stop_str_in_output:
            return ""  # the ending token's text is not part of the output, as in vLLM
        self.text += delta
        return delta

    def _piece(self, token_id: int) -> str | None:
        return self.detokenizer.tokenizer.decode([token_id], skip_special_tokens=False) if self.detokenizer else None

    def completion_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.output_token_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                self.logprobs, self.finish_reason, self.stop_reason)
