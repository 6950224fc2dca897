"""SamplingParams: what a request asks of generation, validated up front (vLLM names and defaults)."""
from __future__ import annotations

import dataclasses
import math

# Top-n logprobs are computed on device for a fixed n (one program for every request), as OpenAI's cap.
MAX_LOGPROBS = 20
# Documented per-request limits: every generated token is checked against the stop lists on the host, so their
# size bounds that work (a 1 MiB body could otherwise carry half a million stop ids).
MAX_STOP = 16  # stop strings
MAX_STOP_LENGTH = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 32
# Tokens that min_tokens keeps from ending a sequence (EOS ids + stop ids), per row, in a fixed-size device array.
MAX_BANNED_TOKENS = 64
# Logit controls (OpenAI's and vLLM's limits): logit_bias entries (OpenAI's cap) and their range, the penalties' range,
# and bad words, whose multi-token spellings become a fixed number of conditional bans per row on device.
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64
MAX_BAD_WORD_LENGTH = 256  # characters
MAX_BAD_WORD_BANS = 2 * MAX_BAD_WORDS  # a word has at most two spellings (jaxserve.sample.logit_controls)
# Integers a step's int32 device arrays hold: a larger top_k or token id must fail here, not in the engine loop.
INT32_LIMIT = 2 ** 31


@dataclasses.dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's names): exactly one of a JSON schema, any JSON object, a regular
    expression, one of a list of strings, or a Lark grammar (llguidance's dialect). Compiled against the model's
    tokenizer when the request is admitted (`jaxserve.structured_output`)."""
    json: dict | str | None = None  # a JSON schema, as an object or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # The grammar applies from the token after these appear in the output (a reasoning model's end tag, as the
    # tokenizer spells it: jaxserve.openai.reasoning); before them the output is free. None: from the first token.
    starts_after: list[int] | None = None

    def __post_init__(self):
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] * bool(self.json_object)
        _check(len(kinds) == 1, f"structured_outputs needs exactly one of json, json_object, regex, choice or grammar, "
                                f"got {kinds or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json must be a JSON "
                                                                         "schema (an object or its text)")
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs.regex must be a string")
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs.grammar must be a string")
        _check(self.choice is None or (isinstance(self.choice, list) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice must be a non-empty list of strings")
        _check(self.starts_after is None or (isinstance(self.starts_after, list) and self.starts_after
                                             and all(type(t) is int and 0 <= t < INT32_LIMIT
                                                     for t in self.starts_after)),
               "structured_outputs.starts_after must be a non-empty list of token ids")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len; 0 (with prompt_logprobs): score the prompt only
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the chosen token's is always given)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # Logit controls, applied on device in vLLM's order after the token mask and min_tokens bans: logit_bias, then
    # the penalties (jaxserve.sample.sampling). Token ids are checked against the vocabulary at admission.
    presence_penalty: float = 0.0  # OpenAI: minus this from a token's logit once it has been generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per time a token has been generated
    repetition_penalty: float = 1.0  # HF/vLLM: a token in the prompt or output has its logit divided (> 0) or
    #                                  multiplied (< 0) by this
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (vLLM: each word's tokens, with and without a leading space)
    # Prompt logprobs (vLLM): None, or each prompt token's logprob (after the first) and the top n at its position.
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and 0 <= self.top_k < INT32_LIMIT,
               f"top_k must be an integer >= 0 (or -1), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
               f"max_tokens must be an integer >= 1 (or 0 with prompt_logprobs), got {self.max_tokens!r}")
        _check(self.max_tokens != 0 or self.prompt_logprobs is not None,
               "max_tokens may be 0 only with prompt_logprobs (to score a prompt without generating)")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens < INT32_LIMIT,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(len(self.stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings, got {len(self.stop)}")
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
               f"a stop string may have at most {MAX_STOP_LENGTH} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < INT32_LIMIT
                   for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams")
        self._check_choice_reaches_min_tokens()
        self._check_logit_controls()

    def _check_choice_reaches_min_tokens(self) -> None:
        """A choice every string of which ends before min_tokens: once it is written the grammar allows only EOS,
        which min_tokens bans, so no output could obey both. Each token spells at least one byte, so a string is
        at most its UTF-8 length in tokens; known without the tokenizer (other grammars need compiling)."""
        choice = self.structured_outputs.choice if self.structured_outputs is not None else None
        if not choice or not self.min_tokens:
            return
        longest = max(len(c.encode("utf-8", "surrogatepass")) for c in choice)
        _check(self.min_tokens <= longest,
               f"min_tokens ({self.min_tokens}) can never be reached under structured_outputs.choice: its longest "
               f"string is {longest} bytes, at most {longest} tokens, and only EOS may follow it", "min_tokens")

    def _check_logit_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}", name)
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0 and
               math.isfinite(self.repetition_penalty),
               f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias must be a dict of token id -> bias", "logit_bias")
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
                   f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", "logit_bias")
            _check(all(_is_token_id(t) for t in self.logit_bias),
                   f"logit_bias keys must be token ids (integers >= 0), got {list(self.logit_bias)[:8]!r}",
                   "logit_bias")
            _check(all(_is_number(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
                   "logit_bias values must be numbers in [-100, 100]", "logit_bias")
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, list) and self.allowed_token_ids and
                   all(_is_token_id(t) for t in self.allowed_token_ids),
                   "allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words must be a list of non-blank strings", "bad_words")
            _check(len(self.bad_words) <= MAX_BAD_WORDS,
                   f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}", "bad_words")
            _check(all(len(w) <= MAX_BAD_WORD_LENGTH for w in self.bad_words),
                   f"a bad word may have at most {MAX_BAD_WORD_LENGTH} characters", "bad_words")

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < INT32_LIMIT


class ParamError(ValueError):
    """A bad request parameter, named (the server's 400 carries it as `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _check(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise ParamError(message, param)
