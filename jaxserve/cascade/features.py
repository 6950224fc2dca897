"""What a tier's own model says about a request: numbers read off its outputs, for a router's classifiers.

Prompt features cost at most the model's prefill of the prompt: one scoring pass (`score_params`: the prompt's own
token logprobs and the first answer token's top SCORE_TOPK) gives all of them, and with the prefix cache the tier's
generation then reuses the prompt's pages. Answer features come from an answer generated with logprobs (>= 0: each
sampled token's own logprob).

Pure python over `RequestOutput` / `CompletionOutput`: nothing here calls an engine, so the scripts that train a
router (scripts/train_router.py) and the server that applies it compute the very same numbers.
"""
from __future__ import annotations

import math

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

# Top logprobs of the first answer token the entropy and margin are read from: enough to hold nearly all of the mass
# of a confident model's distribution, and what the device computes for every request anyway (MAX_LOGPROBS).
SCORE_TOPK = min(20, MAX_LOGPROBS)

PROMPT_FEATURES = ("prompt_tokens_log", "prompt_mean_logprob", "prompt_min_logprob", "first_logprob",
                   "first_margin", "first_entropy")
ANSWER_FEATURES = ("answer_mean_logprob", "answer_min_logprob", "answer_tokens_log")
FEATURES = PROMPT_FEATURES + ANSWER_FEATURES


def score_params() -> SamplingParams:
    """The scoring pass of a prompt: its own tokens' logprobs (prompt_logprobs 0: no top-n) and the first answer
    token's top SCORE_TOPK, one greedy token generated (which is dropped)."""
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=SCORE_TOPK, ignore_eos=True)


def prompt_features(output: RequestOutput) -> dict[str, float]:
    """PROMPT_FEATURES of a request's output that carries its prompt logprobs (prompt_logprobs >= 0) and its first
    answer token's top logprobs (logprobs >= 2, SCORE_TOPK as `score_params` asks: the entropy is of those)."""
    ids = output.prompt_token_ids
    scored = output.prompt_logprobs
    if scored is None or len(scored) != len(ids):
        raise ValueError(f"request {output.request_id}: prompt features need its prompt logprobs (prompt_logprobs "
                         f">= 0), whole ({0 if scored is None else len(scored)} of {len(ids)} positions)")
    # scored[0] is None: the first prompt token has no position before it.
    own = [entry[token].logprob for token, entry in zip(ids[1:], scored[1:])]
    completion = output.outputs[0] if output.outputs else None
    if completion is None or not completion.logprobs:
        raise ValueError(f"request {output.request_id}: prompt features need its first answer token's top logprobs "
                         f"(logprobs >= 2)")
    first = _top_logprobs(completion.logprobs[0])
    if len(first) < 2:
        raise ValueError(f"request {output.request_id}: prompt features need its first answer token's top logprobs "
                         f"(logprobs >= 2), got {len(first)}")
    return {"prompt_tokens_log": math.log1p(len(ids)),
            "prompt_mean_logprob": sum(own) / len(own) if own else 0.0,
            "prompt_min_logprob": min(own) if own else 0.0,
            "first_logprob": first[0],
            "first_margin": first[0] - first[1],
            "first_entropy": _entropy(first[:SCORE_TOPK])}


def answer_features(completion: CompletionOutput) -> dict[str, float]:
    """ANSWER_FEATURES of one whole answer generated with logprobs >= 0. An empty answer (its first token ended it,
    not shown) has mean and min 0.0: nothing in it was unlikely."""
    if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
        raise ValueError("answer features need the answer's token logprobs (logprobs >= 0), one per token")
    own = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
    return {"answer_mean_logprob": sum(own) / len(own) if own else 0.0,
            "answer_min_logprob": min(own) if own else 0.0,
            "answer_tokens_log": math.log1p(len(own))}


def _top_logprobs(entry: dict[int, Logprob]) -> list[float]:
    """A generated token's logprobs entry (the top n, ranks 1..n, and the chosen token) -> the top n logprobs,
    descending. A chosen token ranked below n (sampled) is left out unless its rank is n + 1 (then the list is the
    true top n + 1), so that a sampled unlikely token never counts among the top."""
    top = [lp.logprob for lp in entry.values() if lp.rank is not None and lp.rank <= len(entry)]
    return sorted(top, reverse=True)


def _entropy(logprobs: list[float]) -> float:
    """Entropy (nats) of the distribution the given logprobs make once renormalised to sum to 1."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]  # shifted: no underflow of very unlikely tokens
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights if w > 0)
