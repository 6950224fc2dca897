"""How big a request's answer may grow: the per-position logprob counts it may ask for (vLLM's `max_logprobs`) and
the logprob entries its whole answer may hold, checked before any generation; and the JSON encoding of a large
answer in small pieces, so that the thread encoding it does not hold the GIL (and the event loop) for long.

Logprobs are what make an answer large: echo with logprobs and prompt_logprobs score every prompt position, and
each choice repeats them. An "entry" is one logprob in the answer: a position showing its token and its top k counts
k + 1. At ~70 bytes an entry, the default bound (500,000) keeps one answer under ~35 MB; without it 64 prompts x
max_model_len x 21 entries x n reach gigabytes."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from jaxserve.openai.errors import ApiError
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_LOGPROB_ENTRIES = 500_000
# Items of a per-token list encoded by one C call of the json module (which holds the GIL throughout): a position
# holds at most MAX_LOGPROBS + 1 entries, so one call encodes at most ~100 KB (a few milliseconds).
_SLICE = 64


@dataclasses.dataclass(frozen=True)
class LogprobLimits:
    """max_logprobs: the most top logprobs one position may show (logprobs, top_logprobs, prompt_logprobs; vLLM's
    --max-logprobs; at most MAX_LOGPROBS, which the device computes). max_entries: the most logprob entries one
    answer may hold (--max-logprob-entries)."""
    max_logprobs: int = MAX_LOGPROBS
    max_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES

    def __post_init__(self):
        if not (isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the top logprobs computed on device), "
                             f"got {self.max_logprobs!r}")
        if not (isinstance(self.max_entries, int) and self.max_entries >= 1):
            raise ValueError(f"max_logprob_entries must be >= 1, got {self.max_entries!r}")

    def check_counts(self, params: SamplingParams, chat: bool) -> None:
        """A 400 if the request asks a position for more top logprobs than this server shows (vLLM's check)."""
        for field, n in [("top_logprobs" if chat else "logprobs", params.logprobs),
                         ("prompt_logprobs", params.prompt_logprobs)]:
            if n is not None and n > self.max_logprobs:
                raise ApiError(400, f"{field} {n} is more than this server allows per position: at most "
                                    f"{self.max_logprobs} (--max-logprobs)", field)

    def check_entries(self, prompt_lengths: Sequence[int], params: SamplingParams, *, chat: bool, echo: bool,
                      shown_prompt_logprobs: int | None, max_model_len: int) -> None:
        """A 400 if the answer could hold more logprob entries than max_entries (see logprob_entries)."""
        entries = logprob_entries(prompt_lengths, params, chat=chat, echo=echo,
                                  shown_prompt_logprobs=shown_prompt_logprobs, max_model_len=max_model_len)
        if entries > self.max_entries:
            raise ApiError(400, f"the answer could hold {entries:,} logprob entries (prompt positions x "
                                f"(prompt_logprobs + 1) and, with echo, x (logprobs + 1); generated tokens x "
                                f"(logprobs + 1); per choice), more than this server gives one request "
                                f"({self.max_entries:,}, --max-logprob-entries): ask for fewer prompts, choices (n), "
                                f"tokens or logprobs", "logprobs" if params.prompt_logprobs is None
                           else "prompt_logprobs")


def logprob_entries(prompt_lengths: Sequence[int], params: SamplingParams, *, chat: bool, echo: bool,
                    shown_prompt_logprobs: int | None, max_model_len: int) -> int:
    """The most logprob entries the answer to these prompts (their token counts) can hold: per choice, its generated
    tokens' (max_tokens, or up to max_model_len) and with echo its prompt's, each position logprobs + 1; and the
    prompt's shown_prompt_logprobs + 1 a position (vLLM's prompt_logprobs: per choice in completions, once in chat)."""
    total = 0
    for length in prompt_lengths:
        generated = params.max_tokens if params.max_tokens is not None else max(max_model_len - length, 0)
        per_choice = 0
        if params.logprobs is not None:
            per_choice += (generated + (length if echo else 0)) * (params.logprobs + 1)
        prompt_side = 0 if shown_prompt_logprobs is None else length * (shown_prompt_logprobs + 1)
        total += params.n * per_choice + (prompt_side if chat else params.n * prompt_side)
    return total


def encode_json(obj) -> bytes:
    """json.dumps(obj) (its separators, NaN as json.dumps writes it), encoded in small pieces: the json module's C
    encoder holds the GIL for a whole call (0.33 s for a 14 MB answer on a 2-core CPU), while between pieces the
    event loop's thread gets its turn. Objects are walked; the body's own lists of objects (depth <= 1: choices)
    item by item, other lists (per token or position, each item bounded by MAX_LOGPROBS; token ids) in slices of
    _SLICE items."""
    parts: list[str] = []
    _encode(obj, parts.append, 0)
    return "".join(parts).encode()


def _encode(obj, write: Callable[[str], object], depth: int) -> None:
    if isinstance(obj, dict):
        write("{")
        for i, (key, value) in enumerate(obj.items()):
            # json writes a non-string key (int, float, bool, None) as its JSON text in quotes
            write(f"{', ' if i else ''}{json.dumps(key if isinstance(key, str) else json.dumps(key))}: ")
            _encode(value, write, depth + 1)
        write("}")
    elif isinstance(obj, list) and depth <= 1 and obj and isinstance(obj[0], (dict, list)):
        write("[")
        for i, item in enumerate(obj):
            if i:
                write(", ")
            _encode(item, write, depth + 1)
        write("]")
    elif isinstance(obj, list) and len(obj) > _SLICE:
        write("[")
        for start in range(0, len(obj), _SLICE):
            write((", " if start else "") + json.dumps(obj[start:start + _SLICE])[1:-1])
        write("]")
    else:
        write(json.dumps(obj))
