"""Cascade routing's pure parts: the features read off a tier's outputs, the router file (round trip, and every kind
of corrupt file refused naming the file and the field), the classifiers' arithmetic, and the routing policy over
fake tiers with fixed classifiers. No model, no engine."""
import json
import math

import pytest

from jaxserve.cascade import (
    ANSWER_FEATURES,
    PROMPT_FEATURES,
    SCORE_TOPK,
    CascadeRouter,
    RouterFileError,
    TierClassifier,
    answer_features,
    prompt_features,
    score_params,
)
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput

# ---- features ----

def entry(chosen: int, chosen_logprob: float, top: list[tuple[int, float]] | None = None,
          chosen_rank: int | None = None) -> dict:
    """A generated token's logprobs entry as the engine writes it: the top n (ranks 1..n) then the chosen token, if
    it is not among them, with its own rank."""
    e = {t: Logprob(lp, r) for r, (t, lp) in enumerate(top or [], 1)}
    e.setdefault(chosen, Logprob(chosen_logprob, chosen_rank if chosen_rank is not None else 1))
    return e


def scored_output(prompt_lps: list[float], first_top: list[tuple[int, float]], answer=None) -> RequestOutput:
    """A request over the prompt [10, 11, ...] whose token i+1 had logprob prompt_lps[i], whose first answer token's
    top logprobs are first_top (the first of them chosen)."""
    ids = list(range(10, 11 + len(prompt_lps)))
    scored = [None] + [{t: Logprob(lp, 3)} for t, lp in zip(ids[1:], prompt_lps)]
    chosen, chosen_lp = first_top[0]
    completion = CompletionOutput(0, "", [chosen], chosen_lp, [entry(chosen, chosen_lp, first_top)], "length")
    return RequestOutput("r", None, ids, [completion], True, prompt_logprobs=scored)


def test_score_params_is_one_greedy_token_with_the_prompts_own_logprobs():
    p = score_params()
    assert (p.temperature, p.max_tokens, p.prompt_logprobs, p.logprobs, p.n) == (0.0, 1, 0, SCORE_TOPK, 1)
    assert SCORE_TOPK == 20


def test_prompt_features_by_hand():
    first = [(1, math.log(0.5)), (2, math.log(0.25)), (3, math.log(0.125)), (4, math.log(0.125))]
    f = prompt_features(scored_output([-1.0, -3.0, -2.0], first))
    assert list(f) == list(PROMPT_FEATURES)
    assert f["prompt_tokens_log"] == pytest.approx(math.log(1 + 4))
    assert f["prompt_mean_logprob"] == pytest.approx(-2.0)
    assert f["prompt_min_logprob"] == pytest.approx(-3.0)
    assert f["first_logprob"] == pytest.approx(math.log(0.5))
    assert f["first_margin"] == pytest.approx(math.log(2))
    assert f["first_entropy"] == pytest.approx(-(0.5 * math.log(0.5) + 0.25 * math.log(0.25)
                                                 + 2 * 0.125 * math.log(0.125)))


def test_first_token_entropy_is_of_the_renormalised_top():
    # Half of the mass in the top 2, split evenly: renormalised, it is a fair coin (log 2 nats).
    f = prompt_features(scored_output([-1.0], [(1, math.log(0.25)), (2, math.log(0.25))]))
    assert f["first_entropy"] == pytest.approx(math.log(2))
    assert f["first_margin"] == pytest.approx(0.0)


def test_a_one_token_prompt_has_zero_prompt_logprob_features():
    f = prompt_features(scored_output([], [(1, -0.1), (2, -3.0)]))
    assert (f["prompt_tokens_log"], f["prompt_mean_logprob"], f["prompt_min_logprob"]) == (pytest.approx(math.log(2)),
                                                                                           0.0, 0.0)


def test_a_sampled_token_below_the_top_is_not_counted_among_it():
    """The chosen token ranked 57th (sampled, not in the top 2 asked for) must not become the runner-up."""
    ids = [10, 11]
    top = [(1, -0.5), (2, -1.5)]
    completion = CompletionOutput(0, "", [9], -6.0, [entry(9, -6.0, top, chosen_rank=57)], "length")
    out = RequestOutput("r", None, ids, [completion], True, prompt_logprobs=[None, {11: Logprob(-1.0, 2)}])
    f = prompt_features(out)
    assert (f["first_logprob"], f["first_margin"]) == (-0.5, pytest.approx(1.0))
    q = 1 / (1 + math.exp(-1.0))  # the top 2 renormalised: e^-0.5 : e^-1.5
    assert f["first_entropy"] == pytest.approx(-(q * math.log(q) + (1 - q) * math.log(1 - q)))


def test_prompt_features_need_what_the_scoring_pass_asks():
    out = scored_output([-1.0], [(1, -0.1), (2, -3.0)])
    no_prompt = RequestOutput("r", None, out.prompt_token_ids, out.outputs, True, prompt_logprobs=None)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        prompt_features(no_prompt)
    one_logprob = scored_output([-1.0], [(1, -0.1)])  # logprobs 0: the chosen token only
    with pytest.raises(ValueError, match="logprobs >= 2"):
        prompt_features(one_logprob)
    no_answer = RequestOutput("r", None, out.prompt_token_ids, [], True, prompt_logprobs=out.prompt_logprobs)
    with pytest.raises(ValueError, match="first answer token"):
        prompt_features(no_answer)


def test_answer_features_by_hand():
    tokens, lps = [4, 5, 6], [-0.5, -2.0, -0.5]
    c = CompletionOutput(0, "x", tokens, sum(lps), [entry(t, lp) for t, lp in zip(tokens, lps)], "stop")
    f = answer_features(c)
    assert list(f) == list(ANSWER_FEATURES)
    assert f == {"answer_mean_logprob": pytest.approx(-1.0), "answer_min_logprob": -2.0,
                 "answer_tokens_log": pytest.approx(math.log(4))}
    empty = answer_features(CompletionOutput(0, "", [], 0.0, [], "stop"))
    assert empty == {"answer_mean_logprob": 0.0, "answer_min_logprob": 0.0, "answer_tokens_log": 0.0}
    with pytest.raises(ValueError, match="logprobs >= 0"):
        answer_features(CompletionOutput(0, "x", tokens, None, None, "stop"))


# ---- classifiers and router files ----

def clf(features=("first_margin",), weights=(2.0,), mean=None, scale=None, bias=0.0, threshold=0.5):
    return TierClassifier(features, mean or (0.0,) * len(features), scale or (1.0,) * len(features), weights, bias,
                          threshold)


def test_classifier_probability_is_the_standardised_logistic():
    c = TierClassifier(("first_margin", "prompt_tokens_log"), (1.0, 2.0), (2.0, 0.5), (3.0, -1.0), 0.25, 0.6)
    x = {"first_margin": 2.0, "prompt_tokens_log": 3.0, "answer_tokens_log": 99.0}  # extra features are ignored
    z = 0.25 + 3.0 * (2.0 - 1.0) / 2.0 - 1.0 * (3.0 - 2.0) / 0.5
    assert c.probability(x) == pytest.approx(1 / (1 + math.exp(-z)))
    assert c.keeps(x) == (1 / (1 + math.exp(-z)) >= 0.6)
    assert c.keeps(x, threshold=0.0) and not c.keeps(x, threshold=1.0)
    # Far out on either side: no overflow, and the limits.
    assert clf(weights=(1.0,)).probability({"first_margin": 1e6}) == 1.0
    assert clf(weights=(1.0,)).probability({"first_margin": -1e6}) == 0.0
    assert clf(weights=(1.0,)).probability({"first_margin": float("nan")}) == 0.0  # unsure: moves up
    with pytest.raises(ValueError, match="first_margin"):
        clf().probability({"first_logprob": 1.0})


def router(**kw) -> CascadeRouter:
    args = dict(tiers=("small", "large"), before=(clf(),),
                after=(clf(("answer_mean_logprob", "first_margin"), (1.0, 1.0)),), trained_on={"by": "hand"})
    return CascadeRouter(**{**args, **kw})


def test_router_round_trips_through_its_file(tmp_path):
    r = router()
    path = tmp_path / "router.json"
    r.save(path)
    body = json.loads(path.read_text())
    assert (body["format"], body["version"], body["tiers"]) == ("jaxserve-cascade-router", 1, ["small", "large"])
    assert CascadeRouter.load(path) == r
    only_after = router(before=None)
    only_after.save(path)
    assert "before" not in json.loads(path.read_text()) and CascadeRouter.load(path) == only_after


def test_with_threshold_sets_every_classifier():
    r = router().with_threshold(0.9)
    assert {c.threshold for c in (*r.before, *r.after)} == {0.9}
    assert router().before[0].threshold == 0.5  # the original is unchanged
    with pytest.raises(ValueError, match="threshold"):
        router().with_threshold(1.5)


def test_classifiers_per_policy():
    r = router(before=None)
    assert r.classifiers("after") == r.after
    with pytest.raises(ValueError, match="no 'before' classifiers"):
        r.classifiers("before")
    with pytest.raises(ValueError, match="unknown cascade policy"):
        r.classifiers("sideways")


def good_file() -> dict:
    return router().to_json()


def corrupt(change):
    body = good_file()
    change(body)
    return body


def setitem(path, value):
    """A change that sets body[path...] = value (path: keys and indices)."""
    def change(body):
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


@pytest.mark.parametrize("content, field", [
    ("{not json", "not JSON"),
    ('[1, 2]', "(top level)"),
    (corrupt(setitem(["format"], "pickle")), "format"),
    (corrupt(setitem(["version"], 2)), "version"),
    (corrupt(setitem(["version"], True)), "version"),
    (corrupt(setitem(["extra"], 1)), "extra"),
    (corrupt(setitem(["tiers"], "small,large")), "tiers"),
    (corrupt(setitem(["tiers"], ["small"])), "tiers"),
    (corrupt(setitem(["tiers"], ["small", "small"])), "tiers"),
    (corrupt(setitem(["tiers"], ["small", ""])), "tiers[1]"),
    (corrupt(setitem(["tiers"], ["small", "medium", "large"])), "before"),  # 1 classifier for 3 tiers
    (corrupt(lambda b: (b.pop("before"), b.pop("after"))), "before"),
    (corrupt(setitem(["after"], {"features": []})), "after"),
    (corrupt(setitem(["before", 0], [1, 2])), "before[0]"),
    (corrupt(setitem(["before", 0, "features"], ["vibes"])), "before[0].features[0]"),
    (corrupt(setitem(["before", 0, "features"], ["answer_mean_logprob"])), "before[0].features[0]"),
    (corrupt(setitem(["before", 0, "features"], "first_margin")), "before[0].features"),
    (corrupt(setitem(["after", 0, "features"], ["first_margin", "first_margin"])), "after[0].features"),
    (corrupt(setitem(["after", 0, "weights"], [1.0])), "after[0].weights"),
    (corrupt(setitem(["after", 0, "mean"], [0.0, "x"])), "after[0].mean[1]"),
    (corrupt(setitem(["before", 0, "scale"], [0.0])), "before[0].scale[0]"),
    (corrupt(setitem(["before", 0, "scale"], [-1.0])), "before[0].scale[0]"),
    (corrupt(setitem(["before", 0, "bias"], "NaN")), "before[0].bias"),
    (corrupt(setitem(["before", 0, "threshold"], 1.5)), "before[0].threshold"),
    (corrupt(lambda b: b["before"][0].pop("threshold")), "before[0].threshold"),
    (corrupt(setitem(["before", 0, "weight"], 1)), "before[0].weight"),
    (corrupt(setitem(["trained_on"], [])), "trained_on"),
])
def test_a_corrupt_router_file_names_the_file_and_the_field(tmp_path, content, field):
    path = tmp_path / "bad-router.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(RouterFileError) as e:
        CascadeRouter.load(path)
    message = str(e.value)
    assert str(path) in message and field in message, message
    assert "\n" not in message


def test_non_finite_numbers_in_a_router_file_are_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(good_file()).replace('"bias": 0.0', '"bias": Infinity', 1))
    with pytest.raises(RouterFileError, match=r"before\[0\].bias: must be a finite number"):
        CascadeRouter.load(path)


def test_a_missing_router_file_is_a_router_file_error(tmp_path):
    with pytest.raises(RouterFileError, match="nothing.json: cannot be read"):
        CascadeRouter.load(tmp_path / "nothing.json")


# ---- the routing policy, over fake tiers ----

def run(coro):
    import asyncio
    return asyncio.run(coro)


def fake_tiers(features_by_tier: list[list[dict]]):
    """features_of for choose_tier: tier i says features_by_tier[i]; records which tiers were asked."""
    asked = []

    async def features_of(tier):
        asked.append(tier)
        return features_by_tier[tier]
    return features_of, asked


def test_choose_tier_takes_the_first_tier_whose_classifier_keeps_the_request():
    from jaxserve.cascade.policy import choose_tier
    keep_if_confident = clf(("first_margin",), (1.0,), threshold=0.5)  # p >= 0.5 iff first_margin >= 0
    judges = (keep_if_confident, keep_if_confident)  # three tiers
    sure, unsure = {"first_margin": 2.0}, {"first_margin": -2.0}
    for said, tier, asked in [([[sure], [unsure]], 0, [0]), ([[unsure], [sure]], 1, [0, 1]),
                              ([[unsure], [unsure]], 2, [0, 1])]:
        features_of, was_asked = fake_tiers(said)
        route = run(choose_tier(judges, features_of))
        assert (route.tier, was_asked) == (tier, asked)  # the last tier is never asked: it answers regardless
        assert route.escalations == [(i, i + 1) for i in range(tier)]
        assert route.probabilities == pytest.approx(
            tuple(keep_if_confident.probability(f[0]) for f in said[:len(asked)]))
        # Deterministic: the same features, the same route.
        assert run(choose_tier(judges, fake_tiers(said)[0])) == route


def test_a_tier_that_cannot_take_the_request_is_skipped_not_escalated_from():
    """features_of None: the tier is too short for the request; it is moved past, and only a tier that was asked and
    refused is an escalation (to the next tier asked, or the one that answers)."""
    from jaxserve.cascade.policy import choose_tier
    keep_if_confident = clf(("first_margin",), (1.0,), threshold=0.5)
    judges = (keep_if_confident,) * 3  # four tiers
    sure, unsure = [{"first_margin": 2.0}], [{"first_margin": -2.0}]
    features_of, asked = fake_tiers([None, unsure, None])
    route = run(choose_tier(judges, features_of))
    assert (route.tier, asked, route.probabilities[0], route.probabilities[2]) == (3, [0, 1, 2], None, None)
    assert route.escalations == [(1, 3)]
    route = run(choose_tier(judges, fake_tiers([None, sure, None])[0]))
    assert (route.tier, route.escalations) == (1, [])
    route = run(choose_tier(judges, fake_tiers([unsure, None, unsure])[0]))
    assert (route.tier, route.escalations) == (3, [(0, 2), (2, 3)])
    assert run(choose_tier(judges, fake_tiers([None, None, None])[0])).escalations == []


def test_a_request_sent_straight_to_the_last_tier_is_no_escalation():
    """A stream under the after policy without before classifiers goes to the last tier unjudged: a route only."""
    from jaxserve.cascade.policy import Route
    assert Route(2).escalations == [] and Route(2, (0.1, 0.2)).escalations == [(0, 1), (1, 2)]


def test_cascade_metrics_count_escalations_by_the_tiers_moved_between():
    from jaxserve.openai.metrics import ServerMetrics
    metrics = ServerMetrics()
    cascade = metrics.add_cascade("auto", ["a", "b", "c"])
    cascade.routed(2, [(0, 2)], 0.5)  # b skipped
    cascade.routed(2, [], 0.25)  # straight to c
    text = metrics.exposition().decode()

    def value(series):
        return float(next(line for line in text.splitlines() if line.startswith(series + " ")).rsplit(" ", 1)[1])
    assert value('jaxserve:cascade_escalations_total{cascade="auto",from_tier="a",to_tier="c"}') == 1
    assert value('jaxserve:cascade_escalations_total{cascade="auto",from_tier="a",to_tier="b"}') == 0
    assert value('jaxserve:cascade_escalations_total{cascade="auto",from_tier="b",to_tier="c"}') == 0
    assert value('jaxserve:cascade_requests_total{cascade="auto",tier="c"}') == 2
    assert value('jaxserve:cascade_routing_seconds_count{cascade="auto"}') == 2


def test_every_item_must_be_kept():
    """A request of several prompts (or n > 1 answers) stays only if each is kept."""
    from jaxserve.cascade.policy import choose_tier
    judge = clf(("first_margin",), (1.0,))
    features_of, _ = fake_tiers([[{"first_margin": 3.0}, {"first_margin": -0.1}]])
    assert run(choose_tier((judge,), features_of)).tier == 1
    features_of, _ = fake_tiers([[{"first_margin": 3.0}, {"first_margin": 0.1}]])
    assert run(choose_tier((judge,), features_of)).tier == 0


def test_the_threshold_sets_the_quality_cost_point():
    from jaxserve.cascade.policy import choose_tier
    r = router()
    features_of, _ = fake_tiers([[{"first_margin": 0.5}]])  # p = sigmoid(1) = 0.73
    assert run(choose_tier(r.before, features_of)).tier == 0
    assert run(choose_tier(r.with_threshold(0.8).before, features_of)).tier == 1
    assert run(choose_tier(r.with_threshold(0.0).before, fake_tiers([[{"first_margin": -99.0}]])[0])).tier == 0


def test_confidence_rule_keeps_answers_of_high_per_token_probability():
    from jaxserve.cascade.policy import ConfidenceRule, choose_tier
    rule = ConfidenceRule(0.5)
    assert rule.probability({"answer_mean_logprob": math.log(0.6)}) == pytest.approx(0.6)
    assert run(choose_tier((rule,), fake_tiers([[{"answer_mean_logprob": math.log(0.6)}]])[0])).tier == 0
    assert run(choose_tier((rule,), fake_tiers([[{"answer_mean_logprob": math.log(0.4)}]])[0])).tier == 1
    with pytest.raises(ValueError, match="per-token probability"):
        ConfidenceRule(2.0)


def test_cascade_config_resolves_the_policy_and_threshold():
    from jaxserve.cascade.policy import CascadeConfig, ConfidenceRule
    r = router()
    config = CascadeConfig(("small", "large"), router=r)
    assert (config.name, config.policy, config.judges()) == ("auto", "before", r.before)
    assert config.stream_judges() == r.before and config.reads() == {"first_margin"}
    after = CascadeConfig(("small", "large"), policy="after", router=r, threshold=0.7)
    assert after.judges() == r.with_threshold(0.7).after and after.stream_judges() == r.with_threshold(0.7).before
    assert after.reads() == {"answer_mean_logprob", "first_margin"}
    assert CascadeConfig(("small", "large"), router=router(before=None)).policy == "after"
    assert CascadeConfig(("small", "large"), policy="after", router=router(before=None)).stream_judges() is None
    plain = CascadeConfig(("small", "large", "huge"), name="cheap", threshold=0.4)
    assert (plain.policy, plain.judges(), plain.stream_judges()) == ("after", (ConfidenceRule(0.4),) * 2, None)


@pytest.mark.parametrize("args, message", [
    (dict(tiers=("small",), threshold=0.5), "at least 2 tiers"),
    (dict(tiers=("small", "small"), threshold=0.5), "more than once"),
    (dict(tiers=("small", ""), threshold=0.5), "empty"),
    (dict(tiers=("small", "large"), name="small", threshold=0.5), "one of its tiers"),
    (dict(tiers=("small", "large"), name="", threshold=0.5), "must not be empty"),
    (dict(tiers=("small", "large"), policy="sideways", threshold=0.5), "before or after"),
    (dict(tiers=("small", "large"), threshold=1.5), "--cascade-threshold"),
    (dict(tiers=("small", "large"), policy="before", threshold=0.5), "give --router-file"),
    (dict(tiers=("small", "large")), "give --cascade-threshold"),
    (dict(tiers=("large", "small"), router=router()), "the router file is for the tiers small,large"),
    (dict(tiers=("small", "large"), policy="before", router=router(before=None)), "no 'before' classifiers"),
])
def test_cascade_config_errors(args, message):
    from jaxserve.cascade.policy import CascadeConfig
    with pytest.raises(ValueError, match=message):
        CascadeConfig(**args)


# ---- what the after policy asks a tier, and what the client sees of it ----

def test_judged_params_ask_only_what_the_judge_reads():
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.server.cascade import judged_params
    p = SamplingParams(temperature=0, max_tokens=8)
    assert judged_params(p, {"answer_mean_logprob"}) == SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    wide = judged_params(p, {"answer_mean_logprob", "first_margin"})
    assert (wide.logprobs, wide.prompt_logprobs, wide.temperature, wide.max_tokens) == (SCORE_TOPK, 0, 0, 8)
    asked = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=5)
    assert judged_params(asked, {"answer_mean_logprob"}) is asked
    wide = judged_params(asked, {"prompt_mean_logprob"})
    assert (wide.logprobs, wide.prompt_logprobs) == (SCORE_TOPK, 5)


def test_the_client_sees_only_the_logprobs_it_asked_for():
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.server.cascade import as_asked
    top = [(1, -0.1), (2, -1.0), (3, -2.0), (4, -3.0)]
    c = CompletionOutput(0, "x", [1, 9], -6.1, [entry(1, -0.1, top), entry(9, -6.0, top, chosen_rank=40)], None)
    out = RequestOutput("r", None, [5, 6], [c], False, prompt_logprobs=[None, {6: Logprob(-1.0, 7)}])
    none = as_asked(out, SamplingParams())
    assert none.outputs[0].logprobs is None and none.prompt_logprobs is None
    assert none.outputs[0].token_ids == [1, 9] and none.outputs[0].text == "x"
    two = as_asked(out, SamplingParams(logprobs=2, prompt_logprobs=0))
    assert [list(e) for e in two.outputs[0].logprobs] == [[1, 2], [1, 2, 9]]  # the top 2, then the chosen
    assert two.prompt_logprobs == out.prompt_logprobs
    zero = as_asked(out, SamplingParams(logprobs=0))
    assert [list(e) for e in zero.outputs[0].logprobs] == [[1], [9]]
    assert len(out.outputs[0].logprobs[0]) == 4  # the engine's output is left as it was


def test_collected_outputs_and_their_features():
    from jaxserve.server.cascade import _Collected, judged_features
    top = [(1, math.log(0.5)), (2, math.log(0.25))]
    acc = _Collected()
    acc.add(RequestOutput("r", None, [5, 6], [CompletionOutput(0, "a", [1], -0.7, [entry(1, math.log(0.5), top)],
                                                               None)], False,
                          prompt_logprobs=[None, {6: Logprob(-2.0, 4)}]))
    acc.add(RequestOutput("r", None, [5, 6], [CompletionOutput(0, "b", [2], -1.0, [entry(2, -0.3)], "length"),
                                               CompletionOutput(1, "c", [2], -1.0, [entry(2, -0.3)], "length")],
                          True))
    out = acc.output()
    assert [c.text for c in out.outputs] == ["ab", "c"] and out.outputs[0].token_ids == [1, 2]
    assert out.prompt_logprobs[1][6].logprob == -2.0 and out.finished
    items = judged_features([out], {"answer_mean_logprob", "prompt_mean_logprob"})
    assert len(items) == 2  # one per choice
    assert items[0]["prompt_mean_logprob"] == items[1]["prompt_mean_logprob"] == -2.0
    assert items[0]["answer_mean_logprob"] == pytest.approx((math.log(0.5) - 0.3) / 2)
    assert items[1]["answer_mean_logprob"] == pytest.approx(-0.3)
    assert "prompt_mean_logprob" not in judged_features([out], {"answer_mean_logprob"})[0]
