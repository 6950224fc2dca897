"""Cascade routing (issue 27): send each request to the cheapest of several served models that is likely to answer
it well, judged by a small trained router from what the cheaper model itself says about the request.

`features` reads those numbers off a tier's outputs (prompt features: one scoring pass, at most the tier's prefill
of the prompt; answer features: an answer generated with logprobs), `router_file` is the trained router (one
logistic classifier per tier but the last, for each policy, as a JSON file), `policy` the routing decision itself
(route before generating, or escalate after) as plain functions over "what tier i says" callables. The server side
(`jaxserve serve --cascade A,B`) is `jaxserve.server.cascade`; training and evaluation are scripts/train_router.py
and scripts/eval_cascade.py.
"""
from jaxserve.cascade.features import (
                                       ANSWER_FEATURES,
                                       FEATURES,
                                       PROMPT_FEATURES,
                                       SCORE_TOPK,
                                       answer_features,
                                       prompt_features,
                                       score_params,
)
from jaxserve.cascade.router_file import CascadeRouter, RouterFileError, TierClassifier

__all__ = ["ANSWER_FEATURES", "FEATURES", "PROMPT_FEATURES", "SCORE_TOPK", "CascadeRouter", "RouterFileError",
           "TierClassifier", "answer_features", "prompt_features", "score_params"]
