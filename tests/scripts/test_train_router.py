"""scripts/train_router.py: the logistic fit finds a separation that is there, the router file it writes loads back
as the server reads it, and the threshold sweep's arithmetic (share, accuracy retained, cost saved) on a tiny
example worked by hand. No model: synthetic records, seeded (the seed is in every failure message)."""
import json
import sys

import numpy as np
import pytest

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import train_router as tr  # noqa: E402

from jaxserve.cascade.features import ANSWER_FEATURES, PROMPT_FEATURES  # noqa: E402
from jaxserve.cascade.router_file import CascadeRouter  # noqa: E402

ALL_FEATURES = tuple(PROMPT_FEATURES) + tuple(ANSWER_FEATURES)
TIERS = ["small", "large"]


def synthetic_records(seed: int, n: int = 400) -> list[dict]:
    """Records whose label (the small tier is right) is a linear function of two prompt features, measured on very
    different scales and offsets (so standardisation matters), the other features noise."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        f = {k: float(rng.normal()) for k in ALL_FEATURES}
        f["first_margin"] = 3.0 + 0.01 * rng.normal()  # tiny scale, large offset
        f["prompt_mean_logprob"] = -500.0 + 100.0 * rng.normal()  # large scale
        z = 2 * (f["first_margin"] - 3.0) / 0.01 - (f["prompt_mean_logprob"] + 500.0) / 100.0
        small_right = bool(z > 0)
        records.append({"features": f, "split": "train", "score_seconds": 0.1,
                        "tiers": {"small": {"correct": small_right, "seconds": 1.0},
                                  "large": {"correct": bool(rng.random() < 0.9), "seconds": 3.0}}})
    return records


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_a_separation(seed):
    records = synthetic_records(seed)
    names = tuple(PROMPT_FEATURES)
    X = tr.feature_matrix(records, names)
    y = np.array([r["tiers"]["small"]["correct"] for r in records])
    clf = tr.train_classifier(X, y, names, l2=0.01)
    p = tr.probabilities(clf, records)  # through the router file's own TierClassifier.probability
    accuracy = float(((p >= 0.5) == y).mean())
    assert accuracy >= 0.97, f"seed {seed}: the fit separates only {accuracy:.3f} of a separable set"
    w = dict(zip(names, clf.weights))
    # Standardised weights point along the true normal (2, -1) in (first_margin, prompt_mean_logprob), each
    # feature's unit being its own standard deviation; noise features stay small beside them.
    normal = np.array([w["first_margin"], w["prompt_mean_logprob"]])
    cosine = normal @ np.array([2.0, -1.0]) / (np.linalg.norm(normal) * np.sqrt(5.0))
    assert cosine > 0.95, f"seed {seed}: weights {w} point away from the separation (cosine {cosine:.3f})"
    noise = max(abs(v) for k, v in w.items() if k not in ("first_margin", "prompt_mean_logprob"))
    assert noise < 0.25 * np.linalg.norm(normal), f"seed {seed}: noise features weigh {noise:.3f}, weights {w}"


def test_penalty_keeps_separable_weights_finite():
    seed = 3
    records = synthetic_records(seed, n=60)
    names = tuple(PROMPT_FEATURES)
    X, y = tr.feature_matrix(records, names), np.array([r["tiers"]["small"]["correct"] for r in records])
    strong = tr.train_classifier(X, y, names, l2=1.0)
    weak = tr.train_classifier(X, y, names, l2=1e-3)
    assert np.isfinite(weak.weights).all() and np.isfinite(weak.bias), f"seed {seed}: {weak}"
    assert np.linalg.norm(strong.weights) < np.linalg.norm(weak.weights), f"seed {seed}: l2 did not shrink weights"


def test_router_file_round_trips(tmp_path):
    seed = 4
    records = synthetic_records(seed, n=200)
    router, report = tr.train(records, TIERS, l2=1.0, target_retained=0.95, provenance={"command": "test"})
    path = tmp_path / "router.json"
    router.save(path)
    loaded = CascadeRouter.load(path)
    assert loaded == router, f"seed {seed}: the router file did not round-trip"
    assert loaded.tiers == tuple(TIERS) and loaded.trained_on["command"] == "test"
    assert [c.features for c in loaded.before] == [tuple(PROMPT_FEATURES)]
    assert [c.features for c in loaded.after] == [ALL_FEATURES]
    for policy, clfs in (("before", loaded.before), ("after", loaded.after)):
        assert clfs[0].threshold == report[policy]["chosen"]["threshold"], f"seed {seed}: {policy}"
        for r in records[:20]:
            assert clfs[0].probability(r["features"]) == getattr(router, policy)[0].probability(r["features"])
    # The chosen point keeps the target on the records it was chosen on.
    assert report["before"]["chosen"]["retained"] >= 0.95


# ---- the sweep's arithmetic, by hand ----

P = np.array([0.9, 0.6, 0.4, 0.1])
SMALL = np.array([True, True, False, False])
LARGE = np.array([True, False, True, True])  # alone: 3 of 4 right
KEEP, MOVE, ALONE = np.full(4, 1.0), np.full(4, 5.0), np.full(4, 4.0)  # tier 1 alone: 16 s


def test_sweep_arithmetic():
    points = {q["threshold"]: q for q in tr.sweep(P, SMALL, LARGE, KEEP, MOVE, ALONE)}
    assert sorted(points) == [0.0, 0.1, 0.4, 0.6, 0.9, max(points)]  # every threshold that routes differently
    expected = {  # threshold: (share small, accuracy, retained, cost, cost saved)
        0.0: (1.0, 0.5, 2 / 3, 4.0, 0.75),  # tier 0 keeps all: 1 s each
        0.4: (0.75, 0.75, 1.0, 8.0, 0.5),  # keeps 3 (2 right), tier 1 gets the 4th right; 3 x 1 + 5
        0.6: (0.5, 1.0, 4 / 3, 12.0, 0.25),  # the best mix: the cascade beats tier 1 alone here
        0.9: (0.25, 0.75, 1.0, 16.0, 0.0),
    }
    for t, (share, acc, retained, cost, saved) in expected.items():
        q = points[t]
        assert (q["share_small"], q["accuracy"], q["cost_seconds"]) == pytest.approx((share, acc, cost)), (t, q)
        assert (q["retained"], q["cost_saved"]) == pytest.approx((retained, saved)), (t, q)
    top = max(points)  # just above the largest probability: tier 1 answers everything, every request paying MOVE
    assert top > 0.9 and points[top]["share_small"] == 0.0
    assert points[top]["cost_saved"] == pytest.approx(1 - 20.0 / 16.0)
    assert points[top]["retained"] == pytest.approx(1.0)


def test_choose_saves_most_within_target():
    points = tr.sweep(P, SMALL, LARGE, KEEP, MOVE, ALONE)
    assert tr.choose(points, 0.95)["threshold"] == pytest.approx(0.4)  # 50% saved at 100% retained
    # Everything to tier 0 (2/3 retained is enough): thresholds 0 and 0.1 both keep all; the higher is taken.
    assert tr.choose(points, 0.6)["threshold"] == 0.1
    with pytest.raises(ValueError, match="retains"):
        tr.choose(tr.sweep(P, SMALL, np.zeros(4, bool), KEEP, MOVE, ALONE), 0.95)  # tier 1 never right


def test_costs_per_policy():
    records = [{"score_seconds": 0.25, "tiers": {"small": {"seconds": 1.0}, "large": {"seconds": 3.0}}}]
    keep, move, alone = tr.costs(records, TIERS, "before")  # the scoring pass is paid either way
    assert (keep[0], move[0], alone[0]) == (1.25, 3.25, 3.0)
    keep, move, alone = tr.costs(records, TIERS, "after")  # tier 0's answer is paid either way
    assert (keep[0], move[0], alone[0]) == (1.0, 4.0, 3.0)
    with pytest.raises(ValueError, match="policy"):
        tr.costs(records, TIERS, "sometimes")


def test_nothing_to_learn_is_refused():
    records = synthetic_records(5, n=20)
    for r in records:
        r["tiers"]["small"]["correct"] = True
    with pytest.raises(ValueError, match="always right"):
        tr.train(records, TIERS, 1.0, 0.95)


def test_cli(tmp_path, capsys):
    seed = 6
    records = synthetic_records(seed, n=120) + [dict(r, split="test") for r in synthetic_records(seed + 1, n=30)]
    src = tmp_path / "cascade.json"
    src.write_text(json.dumps({"tiers": TIERS, "records": records}))
    out = tmp_path / "router.json"
    assert tr.main(["--records", str(src), "--out", str(out)]) == 0
    router = CascadeRouter.load(out)
    assert router.trained_on["train_records"] == 120, f"seed {seed}: the test split leaked into training"
    assert "before: threshold" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert tr.main(["--records", str(bad), "--out", str(out)]) == 2
    assert "cannot read records" in capsys.readouterr().err


def test_bias_is_not_penalised():
    # With a penalty that pins the weights near 0, the unpenalised bias still gives the base rate (9 in 10 right),
    # not 1/2: a router that knows nothing keeps as often as the small tier is right.
    seed = 7
    rng = np.random.default_rng(seed)
    X, y = rng.normal(size=(200, 3)), np.arange(200) % 10 != 0
    clf = tr.train_classifier(X, y, tuple(PROMPT_FEATURES[:3]), l2=1e4)
    p = clf.probability(dict(zip(PROMPT_FEATURES[:3], X.mean(axis=0))))
    assert p == pytest.approx(0.9, abs=0.01), f"seed {seed}: P at the mean features is {p}, not the base rate"


def test_committed_router_file_serves_the_readme_cascade():
    # scripts/bench_results/cascade_router.json (BENCHMARKS.md, "Cascade routing") is what README's cascade command
    # serves: it must load and name the tiers that command serves, for both policies.
    from jaxserve.cascade.policy import CascadeConfig
    path = SCRIPTS / "bench_results" / "cascade_router.json"
    router = CascadeRouter.load(path)
    for policy in ("before", "after"):
        config = CascadeConfig(("SmolLM2-135M-Instruct", "gemma3-270m"), policy=policy, router=router)
        assert config.policy == policy
