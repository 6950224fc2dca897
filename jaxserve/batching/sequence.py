"""One generated sequence: its tokens and pages (the scheduler's) and what it has said so far (the output
processor's).

Each field has one writer: the scheduler (`jaxserve.batching.scheduler`) writes a Sequence's own fields, the output
processor (`jaxserve.batching.output_processor`) writes its `output` (`OutputState`); everything else only reads
them (`tests/batching/test_state_owners.py` checks it).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.outputs import Logprob
from jaxserve.sample.logit_controls import NONE, LogitControls
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import GrammarGate, GrammarMatcher

if TYPE_CHECKING:
    from jaxserve.lora.request import LoRARequest
    from jaxserve.lora.slot_cache import LoadedAdapter
    from jaxserve.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HANDED_OFF = "handed_off"  # prefilled, its first token taken: its pages wait to be exported to a decode engine
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


@dataclasses.dataclass(frozen=True)
class StopRules:
    """A request's stop rules as sets and lengths: every generated token is checked against them."""
    eos: frozenset[int]
    stop_ids: frozenset[int]
    longest_stop: int  # characters of the longest stop string
    stop_firsts: frozenset[str]  # the first characters of the stop strings
    strings: tuple[str, ...]  # the stop strings (SamplingParams.stop, a list once the params are checked)

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: list[int]) -> "StopRules":
        # Lists once SamplingParams is checked (its __post_init__); the annotations say what it takes.
        assert isinstance(params.stop, list) and params.stop_token_ids is not None
        return cls(frozenset(eos_token_ids), frozenset(params.stop_token_ids), max(map(len, params.stop), default=0),
                   frozenset(s[0] for s in params.stop), tuple(params.stop))


@dataclasses.dataclass
class OutputState:
    """What a sequence has said: its text, logprobs and why it ended. Written by the output processor only."""
    detokenizer: IncrementalDetokenizer | None = None  # or one like it: add(token_id) -> new text
    num_tokens: int = 0  # tokens taken in (the scheduler appends the same ones to output_token_ids)
    text: str = ""  # all of it, including what is held back from the stream
    sent: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None  # per token, when logprobs were asked
    grammar: GrammarMatcher | None = None  # structured output: where the text stands in its grammar, while it runs
    gate: GrammarGate | None = None  # while the grammar waits for a reasoning end tag (None: it applies)
    # Prompt logprobs (vLLM's layout): None for the first prompt token, then per position the prompt token's and the
    # top n at it; collected chunk by chunk (None when not asked, and for a request's sequences but its first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


_arrivals = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_model_len: int, eos_token_ids: list[int], detokenizer: IncrementalDetokenizer | None = None,
                 priority: int = 0, controls: LogitControls = NONE, grammar: GrammarMatcher | None = None,
                 lora: LoadedAdapter | None = None, gate: GrammarGate | None = None):
        # What the request asked: never changes.
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.prompt_token_ids = list(prompt_token_ids)
        self.priority = priority  # lower runs first, as in vLLM
        self.arrival = next(_arrivals)
        self.arrival_time = time.monotonic()
        self.params = params
        self.seed = seed
        self.max_model_len = max_model_len
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        # What min_tokens bans on device, each id once: EOS and stop ids (a list once SamplingParams is checked).
        # Under a grammar EOS is banned even with ignore_eos: the grammar's mask allows EOS wherever the grammar may
        # end, and taking it completes the grammar, which ends the sequence all the same.
        assert params.stop_token_ids is not None
        banned_eos = list(eos_token_ids) if grammar is not None else self.eos_token_ids
        self.ending_token_ids = tuple(dict.fromkeys(banned_eos + params.stop_token_ids))
        self.controls = controls  # logit_bias, allowed_token_ids and bad_words on the model's vocabulary
        self.lora = lora  # its LoRA adapter (None: the base model), held from here on (see jaxserve.lora.slot_cache)
        # The scheduler's.
        self.output_token_ids: list[int] = []
        self.token_ids = TokenIds(self.prompt_token_ids, self.output_token_ids)
        # The same tokens as an array, kept where penalties count them: each step copies a row's tokens from it (from
        # the lists, 64 rows of 512 tokens took ~1.2 ms a step; from arrays, ~0.12 ms).
        self.token_ids_array: np.ndarray | None = None
        if params.uses_penalties:
            self.token_ids_array = np.zeros(max_model_len, np.int32)
            self.token_ids_array[:len(self.prompt_token_ids)] = self.prompt_token_ids
        self.status = Status.WAITING
        self.boost = 0  # earned by waiting: subtracted from priority, so no request starves
        self.waited_steps = 0
        self.num_preemptions = 0
        self.pages: list[int] = []
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages (see jaxserve.cache.page_keys)
        self.num_published = 0  # of its pages, how many the prefix cache has been told about
        self.num_cached = 0  # tokens whose K/V are in the cache, or written by a step already dispatched
        self.num_written = 0  # of those, tokens written by steps that have completed
        self.num_draft_cached = 0  # tokens whose K/V a draft model has in its own cache (same pages)
        # Prompt tokens found in the prefix cache (device or host tier) when first admitted, as vLLM's
        # num_cached_tokens (usage.prompt_tokens_details.cached_tokens); None until then. A preemption's readmission
        # finds its own pages again: not counted.
        self.num_cached_prompt_tokens: int | None = None
        self.pending = 0  # rows sampled by a dispatched step and not yet read back (0 or 1)
        self.slot: int | None = None  # its row in the device-side buffer of last sampled tokens, while running
        self.lora_slot = -1  # the device slot of its adapter, while running (-1: none)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # The output processor's.
        self.stop_rules = StopRules.of(params, self.eos_token_ids)
        self.output = OutputState(detokenizer, logprobs=[] if params.logprobs is not None else None, grammar=grammar,
                                  gate=gate if grammar is not None else None,
                                  prompt_logprobs=[None] if params.prompt_logprobs is not None and index == 0 else None)

    @property
    def lora_request(self) -> LoRARequest | None:
        return self.lora.request if self.lora is not None else None

    @property
    def prefix_salt(self) -> bytes:
        """What its prefix-cache keys start from: the adapter's content key (its KV is that adapter's, never another's
        nor the base model's), or nothing for the base model."""
        return self.lora.key if self.lora is not None else b""

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
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked and not all collected yet: its prompt is computed whole (no prefix-cache
        hit), and its prompt chunks ask the step for them."""
        scored = self.output.prompt_logprobs
        return scored is not None and len(scored) < len(self.prompt_token_ids)

    @property
    def reached_length_limit(self) -> bool:
        """Ends at length once the in-flight token lands: nothing more to schedule. max_tokens 0 (score a prompt)
        counts as 1: the prompt's last token must still be computed, and the token it samples is dropped."""
        limit = self.max_model_len if self.params.max_tokens is None else max(self.params.max_tokens, 1)
        return self.num_generated >= limit or self.num_tokens >= self.max_model_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    # Read-only views of the output processor's state.
    @property
    def text(self) -> str:
        return self.output.text

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.output.stop_reason
