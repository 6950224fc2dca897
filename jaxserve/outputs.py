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
    finish_reason: str | None = None  # "stop" or "length"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
