"""Trains a cascade's router from labelled records and writes the router file `jaxserve serve --router-file` loads.

    python scripts/train_router.py --records scripts/bench_results/cascade.json \
        --out scripts/bench_results/cascade_router.json [--l2 1.0] [--target-retained 0.95]

A record is one question as scripts/eval_cascade.py writes them (its JSON's "records"): whether each tier answered
it right ("tiers": {name: {"correct", "seconds", ...}}), what tier 0's own model said about it ("features": the
keys of jaxserve.cascade.features' PROMPT_FEATURES and ANSWER_FEATURES), the seconds tier 0's scoring pass took for
it ("score_seconds") and its "split" ("train" or "test"). Only the train split is used here.

Two classifiers, each a logistic regression with an L2 penalty on standardised features, predicting "tier 0's
answer is right": "before" over the prompt features (routing before generating: costs tier 0's prefill), "after"
over prompt + answer features (escalating after tier 0 answered). Each one's threshold is the point of the train
split's sweep that saves the most cost while keeping --target-retained of the large tier's accuracy (`sweep`, below,
is the arithmetic; eval_cascade.py runs it on the test split).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from jaxserve.cascade.features import ANSWER_FEATURES, PROMPT_FEATURES
from jaxserve.cascade.router_file import CascadeRouter, TierClassifier

POLICIES = {"before": tuple(PROMPT_FEATURES), "after": tuple(PROMPT_FEATURES) + tuple(ANSWER_FEATURES)}


# ---- fitting ----

def standardise(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X [n, d] -> (mean [d], scale [d]): a constant feature gets scale 1, so it standardises to 0 rather than NaN."""
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    return mean, np.where(scale > 1e-12, scale, 1.0)


def fit_logistic(Z: np.ndarray, y: np.ndarray, l2: float, iters: int = 50) -> tuple[np.ndarray, float]:
    """Z [n, d] standardised features, y [n] in {0, 1} -> (weights [d], bias) minimising the mean log loss plus
    l2/2 * |w|^2 (the bias unpenalised). Newton's method: d is a handful of features, so each step is a d+1 square
    solve, and the penalty keeps the Hessian positive definite even on separable data (where the unpenalised
    weights would run off to infinity)."""
    n, d = Z.shape
    A = np.concatenate([Z, np.ones((n, 1))], axis=1)  # [n, d+1]: the bias as a last column of ones
    penalty = np.full(d + 1, l2)
    penalty[-1] = 0.0
    theta = np.zeros(d + 1)
    for _ in range(iters):
        p = _sigmoid(A @ theta)  # [n]
        grad = A.T @ (p - y) / n + penalty * theta  # [d+1]
        hess = (A * (p * (1 - p))[:, None]).T @ A / n + np.diag(penalty) + 1e-9 * np.eye(d + 1)  # [d+1, d+1]
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return theta[:-1], float(theta[-1])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), without overflow for large |z|


def feature_matrix(records: list[dict], names: tuple[str, ...]) -> np.ndarray:
    """[n, len(names)]: each record's tier-0 features in `names` order (ValueError for a non-finite one: a
    classifier's mean and scale must be finite to be saved)."""
    X = np.array([[float(r["features"][k]) for k in names] for r in records], dtype=np.float64).reshape(
        len(records), len(names))
    bad = np.argwhere(~np.isfinite(X))
    if len(bad):
        i, j = bad[0]
        raise ValueError(f"record {records[i].get('id', i)}: feature {names[j]} is {X[i, j]}")
    return X


def train_classifier(X: np.ndarray, y: np.ndarray, names: tuple[str, ...], l2: float,
                     threshold: float = 0.5) -> TierClassifier:
    """X [n, d] raw features (columns named by `names`), y [n] in {0, 1}: P(tier 0 is right) as the router file's
    classifier (its probability is sigmoid(bias + sum(w * (x - mean) / scale)))."""
    mean, scale = standardise(X)
    weights, bias = fit_logistic((X - mean) / scale, y.astype(np.float64), l2)
    return TierClassifier(features=tuple(names), mean=tuple(map(float, mean)), scale=tuple(map(float, scale)),
                          weights=tuple(map(float, weights)), bias=bias, threshold=float(threshold))


def probabilities(clf: TierClassifier, records: list[dict]) -> np.ndarray:
    """[n]: the classifier's P(tier 0 is right) for each record, as the server computes it."""
    return np.array([clf.probability(r["features"]) for r in records], dtype=np.float64)


# ---- the threshold sweep ----

def costs(records: list[dict], tiers: list[str], policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record, seconds of: (kept by tier 0, moved up to tier 1, tier 1 alone). "before" pays tier 0's scoring
    pass either way; "after" pays tier 0's whole answer either way, and tier 1's too when it escalates."""
    small = np.array([r["tiers"][tiers[0]]["seconds"] for r in records], dtype=np.float64)
    large = np.array([r["tiers"][tiers[1]]["seconds"] for r in records], dtype=np.float64)
    if policy == "before":
        score = np.array([r["score_seconds"] for r in records], dtype=np.float64)
        return score + small, score + large, large
    if policy == "after":
        return small, small + large, large
    raise ValueError(f"unknown policy {policy!r} (before or after)")


def correctness(records: list[dict], tiers: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """([n] tier 0 right, [n] tier 1 right) as booleans."""
    return tuple(np.array([bool(r["tiers"][t]["correct"]) for r in records]) for t in tiers)


def thresholds_for(p: np.ndarray) -> np.ndarray:
    """Every threshold that routes differently: 0 (tier 0 keeps all), each distinct probability, and one just above
    the largest (tier 0 keeps none; a router file's thresholds are probabilities, so at most 1)."""
    top = min(np.nextafter(p.max(), np.inf), 1.0) if len(p) else 1.0
    return np.unique(np.concatenate([[0.0], p, [top]]))


def sweep(p: np.ndarray, small_correct: np.ndarray, large_correct: np.ndarray, cost_keep: np.ndarray,
          cost_move: np.ndarray, cost_large: np.ndarray, thresholds: np.ndarray | None = None) -> list[dict]:
    """All [n] per request. At each threshold t, tier 0 keeps the requests with p >= t and tier 1 answers the rest:
        share_small = kept / n
        accuracy    = (right answers: tier 0's on kept, tier 1's on the rest) / n
        retained    = accuracy / (tier 1 alone's accuracy)
        cost_saved  = 1 - (cost_keep on kept + cost_move on the rest) / (cost_large summed)
    One dict per threshold, ascending."""
    large_acc = float(large_correct.mean())
    large_cost = float(cost_large.sum())
    points = []
    for t in (thresholds_for(p) if thresholds is None else thresholds):
        keep = p >= t
        accuracy = float(np.where(keep, small_correct, large_correct).mean())
        cost = float(np.where(keep, cost_keep, cost_move).sum())
        points.append({"threshold": float(t), "share_small": float(keep.mean()), "accuracy": accuracy,
                       "retained": accuracy / large_acc if large_acc > 0 else math.nan,
                       "cost_seconds": cost, "cost_saved": 1.0 - cost / large_cost})
    return points


def choose(points: list[dict], target_retained: float) -> dict:
    """The point that saves the most cost while retaining at least target_retained of tier 1's accuracy (ties: the
    higher threshold, the safer). The last point (tier 0 keeps nothing) retains 1.0, so there is always one, unless
    tier 1 answers nothing right."""
    ok = [q for q in points if q["retained"] >= target_retained - 1e-12]
    if not ok:
        raise ValueError(f"no threshold retains {target_retained} of the large tier's accuracy")
    return max(ok, key=lambda q: (q["cost_saved"], q["threshold"]))


# ---- the router ----

def train(records: list[dict], tiers: list[str], l2: float, target_retained: float,
          provenance: dict | None = None) -> tuple[CascadeRouter, dict]:
    """Fits both policies' classifiers on `records` (the train split) and sets each one's threshold by `choose` on
    the same records. Returns the router and, per policy, the train split's sweep and the chosen point."""
    if len(tiers) != 2:
        raise ValueError(f"train_router handles two tiers, got {tiers}")
    y_small, y_large = correctness(records, tiers)
    if y_small.all() or not y_small.any():
        raise ValueError(f"tier 0 ({tiers[0]}) is {'always' if y_small.all() else 'never'} right on the "
                         f"{len(records)} training records: nothing to learn")
    classifiers, report = {}, {}
    for policy, names in POLICIES.items():
        clf = train_classifier(feature_matrix(records, names), y_small, names, l2)
        points = sweep(probabilities(clf, records), y_small, y_large, *costs(records, tiers, policy))
        chosen = choose(points, target_retained)
        classifiers[policy] = dataclasses.replace(clf, threshold=chosen["threshold"])
        report[policy] = {"chosen": chosen, "curve": points}
    trained_on = {"date": time.strftime("%Y-%m-%d"), "train_records": len(records), "l2": l2,
                  "target_retained": target_retained, "label": f"{tiers[0]} answered right",
                  "tier_accuracy": {t: float(c.mean()) for t, c in zip(tiers, (y_small, y_large))},
                  **(provenance or {})}
    router = CascadeRouter(tiers=tuple(tiers), before=(classifiers["before"],), after=(classifiers["after"],),
                           trained_on=trained_on)
    return router, report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="JSON written by scripts/eval_cascade.py")
    ap.add_argument("--out", required=True, help="router file to write")
    ap.add_argument("--l2", type=float, default=1.0, help="L2 penalty on the standardised weights (default 1.0)")
    ap.add_argument("--target-retained", type=float, default=0.95,
                    help="keep at least this share of the large tier's accuracy (default 0.95)")
    args = ap.parse_args(argv)
    try:
        data = json.loads(Path(args.records).read_text())
        tiers, records = list(data["tiers"]), [r for r in data["records"] if r["split"] == "train"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"train_router: cannot read records from {args.records}: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"train_router: {args.records} has no train-split records", file=sys.stderr)
        return 2
    try:
        router, report = train(records, tiers, args.l2, args.target_retained,
                               {"command": "python " + " ".join(sys.argv), "records": str(args.records)})
    except (ValueError, KeyError) as e:
        print(f"train_router: {e}", file=sys.stderr)
        return 2
    router.save(args.out)
    for policy, r in report.items():
        c = r["chosen"]
        print(f"{policy}: threshold {c['threshold']:.4f} on {len(records)} train records: {tiers[0]} serves "
              f"{100 * c['share_small']:.1f}%, retains {100 * c['retained']:.1f}% of {tiers[1]}'s accuracy, "
              f"saves {100 * c['cost_saved']:.1f}% of its cost")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
