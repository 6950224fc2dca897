"""What generation returns, shaped like vLLM's outputs."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: {token_id: Logprob} holding the chosen token and the top-n (when logprobs was asked).
    logprobs: list[dict[int, Logprob]] | None
    # "stop", "length", or "error" (vLLM's: no token left within its constraints, or a failed grammar); None while
    # running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of a request's life, as vLLM reports them."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # With prompt_logprobs (vLLM's layout): None for the first prompt token, then per position {token id: Logprob}
    # holding the prompt token and the top n. A stream carries them once, in its first output after they are whole.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A prefill engine's (role "prefill") last output of a request: its sequence left for a decode engine with its
    # KV pages (a jaxserve.batching.kv_handoff.HandOff), the export dispatched. None otherwise.
    handed_off: object | None = None
    # Prompt tokens served from the prefix cache (device or host tier) rather than computed, as vLLM's: the
    # request's usage.prompt_tokens_details.cached_tokens. None before the request is first scheduled.
    num_cached_tokens: int | None = None


def merged(deltas: list[CompletionOutput]) -> list[CompletionOutput]:
    """One delta per completion, in order: a sequence can advance twice in one engine step (a speculative step
    reads back the step before it, then runs its own), and a stream's consumer sees one output per index, as
    vLLM's DELTA outputs."""
    if len({d.index for d in deltas}) == len(deltas):
        return deltas  # the common case: nothing to merge, nothing copied
    by_index: dict[int, CompletionOutput] = {}
    for d in deltas:  # new objects, never a write into one: the output processor owns what it streamed
        m = by_index.get(d.index)
        by_index[d.index] = d if m is None else dataclasses.replace(
            d, text=m.text + d.text, token_ids=[*m.token_ids, *d.token_ids],
            logprobs=None if m.logprobs is None else [*m.logprobs, *(d.logprobs or ())])
    return list(by_index.values())
