"""The `before` policy's scoring pass on the tiny random model: it asks the step for its prompt's own logprobs only
(prompt_logprobs 0), so the step runs no top-k at the prompt's positions, and its features and routing are those
of a full log_softmax over every position's logits (the computation it replaced: the top-k ran at every position)."""
import asyncio

import numpy as np
import pytest

from jaxserve.cascade import TierClassifier, prompt_features, score_params
from jaxserve.cascade.features import PROMPT_FEATURES, SCORE_TOPK
from jaxserve.cascade.policy import choose_tier
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.runner.batch_builder import Row, build_batch

from tiny import make_llm, prompts, step_logits


def reference_features(llm, ids: list[int]) -> dict[str, float]:
    """The features from the logits of every prompt position (one step, the engine's own params), numpy's
    log_softmax over them: each prompt token's logprob, and the top SCORE_TOPK after the prompt."""
    logits = step_logits(llm, ids).astype(np.float64)  # [n, V]
    logprobs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    own = [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]
    last = logprobs[-1]
    order = np.argsort(-last, kind="stable")[:SCORE_TOPK]
    first = CompletionOutput(0, "", [int(order[0])], 0.0,
                             [{int(t): Logprob(float(last[t]), r) for r, t in enumerate(order, 1)}], None)
    scored = [None] + [{ids[p]: Logprob(lp, None)} for p, lp in zip(range(1, len(ids)), own)]
    return prompt_features(RequestOutput("ref", "", ids, [first], True, prompt_logprobs=scored))


def test_scoring_pass_features_and_route_equal_a_full_log_softmax(tiny_dir):
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    rng = np.random.default_rng(seed)
    llm = make_llm(tiny_dir, max_num_batched_tokens=32)
    batch = prompts(rng, [23, 9, 2, 17])
    got = [prompt_features(out) for out in llm.generate(batch, score_params(), use_tqdm=False)]
    ref = [reference_features(llm, p["prompt_token_ids"]) for p in batch]
    for g, r in zip(got, ref):
        assert g.keys() == set(PROMPT_FEATURES)
        for name in PROMPT_FEATURES:
            assert g[name] == pytest.approx(r[name], abs=5e-5, rel=1e-5), (name, seed)
    # A classifier centred on the reference's own features: its decision turns on small differences, and is the same.
    mean = [float(np.mean([r[f] for r in ref])) for f in PROMPT_FEATURES]
    clf = TierClassifier(PROMPT_FEATURES, mean, [1.0] * len(mean), [1.0, 0.5, 0.5, 1.0, 0.3, -0.2], 0.0, 0.5)

    async def route(items):
        async def features_of(tier):
            return items
        return await choose_tier([clf], features_of)
    for g, r in zip(got, ref):
        mine, theirs = asyncio.run(route([g])), asyncio.run(route([r]))
        assert mine.tier == theirs.tier and mine.probabilities == pytest.approx(theirs.probabilities, abs=1e-5), seed


def test_a_prompt_scored_without_top_n_asks_the_step_for_no_top_k():
    """prompt_logprobs 0 leaves the step's prompt_top all False (the device skips the top-k of every block);
    prompt_logprobs > 0 marks the row's scored positions."""
    bare = Row([5, 6, 7], 0, [1], prompt_targets=[6, 7], score_from=0)
    top = Row([8, 9], 0, [2], prompt_targets=[9], score_from=0, prompt_top=True)
    alone = build_batch([bare], 4, 32, 8, 2, 1)
    assert alone.prompt_targets[:2].tolist() == [6, 7] and not alone.prompt_top.any()
    both = build_batch([bare, top], 4, 32, 8, 2, 1)
    assert both.prompt_top.tolist() == [False, False, False, True] + [False] * 4
