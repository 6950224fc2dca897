"""A request's token-level controls on the host: logit_bias, allowed_token_ids and bad_words, resolved against the
model's vocabulary and tokenizer once, when the request is admitted, then turned into a row's device inputs each step
(`jaxserve.sample.sampling` applies them; the penalties need no resolving and come straight from SamplingParams).

bad_words follow vLLM: each word is tokenized as it would start the text and, where that gives other tokens, after
a space; a one-token spelling is never sampled (a bit cleared in the row's token mask), a longer one's last token
may not follow its other tokens. That second rule depends on the row's last token, which may still be on the device
when the host plans the step (async scheduling, `jaxserve.batching.engine_core`): so the host matches all but
that token and hands the device (trigger, banned) pairs, and the device bans `banned` where the last token is
`trigger` (`jaxserve.sample.sampling.with_step_tokens`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sample.token_mask import allow_all, allowed_ids, allowing, forbidding
from jaxserve.sampling_params import ParamError, SamplingParams


@dataclasses.dataclass(frozen=True)
class LogitControls:
    """What a request's controls are on this model's vocabulary (one per request, shared by its sequences)."""
    token_mask: np.ndarray | None = None  # int32 [ceil(V / 32)]: allowed_token_ids less one-token bad words
    bad_words: tuple[tuple[int, ...], ...] = ()  # the spellings of two tokens or more, as token ids
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # (ids int32 [n], biases float32 [n])


NONE = LogitControls()


def resolve(params: SamplingParams, vocab_size: int, tokenizer=None) -> LogitControls:
    """The controls of `params` on a vocabulary of vocab_size tokens; a ParamError names a token id outside it, or
    bad_words on a model without a tokenizer."""
    def check_ids(ids, param: str) -> None:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ParamError(f"{param} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param)

    bias = None
    if params.logit_bias:
        check_ids(params.logit_bias, "logit_bias")
        bias = (np.fromiter(params.logit_bias.keys(), np.int32, len(params.logit_bias)),
                np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
    mask = None
    if params.allowed_token_ids is not None:
        check_ids(params.allowed_token_ids, "allowed_token_ids")
        mask = allowing(params.allowed_token_ids, vocab_size)
    longer: dict[tuple[int, ...], None] = {}
    single: list[int] = []
    if params.bad_words:
        if tokenizer is None:
            raise ParamError("bad_words need a tokenizer, and this model has none", "bad_words")
        spellings = bad_words_token_ids(params.bad_words, tokenizer)
        check_ids([t for ids in spellings for t in ids], "bad_words")
        single = [ids[0] for ids in spellings if len(ids) == 1]
        if single:
            mask = forbidding(allow_all(vocab_size) if mask is None else mask, single)
        longer = dict.fromkeys(tuple(ids) for ids in spellings if len(ids) > 1)
    if params.allowed_token_ids is not None:
        check_some_allowed(params, single, tokenizer.eos_token_ids if tokenizer is not None else [])
    if mask is None and not longer and bias is None:
        return NONE
    return LogitControls(mask, tuple(longer), bias)


def check_some_allowed(params: SamplingParams, bad_tokens: list[int], eos_token_ids: list[int]) -> None:
    """A ParamError where allowed_token_ids leave nothing to sample: all of them bad words, or (while min_tokens
    bans them) all EOS or stop ids. Such a row would have an empty mask from its first token: refused up front
    rather than ended with an error after its prompt is computed. (A grammar's first mask is checked once compiled:
    `check_first_token`; a later one that leaves nothing ends its row on device: `jaxserve.sample.sampling.NO_TOKEN`.)
    """
    assert params.allowed_token_ids is not None and params.stop_token_ids is not None  # lists once checked
    left = set(params.allowed_token_ids).difference(bad_tokens)
    if not left:
        raise ParamError("allowed_token_ids leave no token to sample: bad_words forbid all of them",
                         "allowed_token_ids")
    ending = set(params.stop_token_ids).union(() if params.ignore_eos else eos_token_ids)
    if params.min_tokens and left <= ending:
        raise ParamError(f"allowed_token_ids leave no token to sample before min_tokens ({params.min_tokens}): "
                         f"they are all end-of-sequence or stop tokens {sorted(left)[:8]}, which min_tokens bans",
                         "allowed_token_ids")


def check_first_token(params: SamplingParams, controls: LogitControls, grammar_mask: np.ndarray,
                      ending_token_ids, vocab_size: int) -> None:
    """A ParamError where a grammar's first mask (`jaxserve.structured_output.fill_masks` of a fresh matcher) leaves
    no first token with the request's own mask (allowed_token_ids, one-token bad_words) and min_tokens' ban of
    `ending_token_ids`: known when the grammar is compiled, so refused then, not ended with an error after the
    prompt is computed. What only later tokens show ends its row on device (`jaxserve.sample.sampling.NO_TOKEN`)."""
    mask = grammar_mask if controls.token_mask is None else controls.token_mask & grammar_mask
    if params.min_tokens:
        mask = forbidding(mask, ending_token_ids)
    if allowed_ids(mask, vocab_size).size:
        return
    kind = params.structured_outputs.kind if params.structured_outputs is not None else "grammar"
    named = [n for n, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                             ("bad_words", bool(params.bad_words)), ("min_tokens", bool(params.min_tokens))) if on]
    # (Not starting with "structured_outputs": the server reads such a message as a grammar's compile error.)
    raise ParamError(f"{' and '.join(named) or 'the request'} leave no first token that structured_outputs.{kind} "
                     "allows: nothing could be sampled", named[0] if named else None)


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's spellings of bad words: each as it would start the text, and after a space where that spelling is as
    many tokens and starts with another one (a tokenizer that adds a prefix space gives the same tokens twice)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def bad_word_bans(bad_words: tuple[tuple[int, ...], ...], generated: list[int], num_generated: int) \
        -> tuple[tuple[int, int], ...]:
    """(trigger, banned) for a row whose last token is generated token number num_generated - 1, whose value may
    still be in flight: `generated` holds at least the tokens before it. vLLM bans a word's last token while the
    generated tokens end with its others; the host checks all of them but the last, the device that one."""
    last = num_generated - 1  # index of the row's last token among the generated ones
    bans: dict[tuple[int, int], None] = {}
    for word in bad_words:
        k = len(word) - 2  # the word's tokens that must come before the last token
        if 0 <= last - k and generated[last - k:last] == list(word[:k]):
            bans[word[-2], word[-1]] = None
    return tuple(bans)
