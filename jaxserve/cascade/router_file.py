"""A trained cascade router: per tier but the last, a logistic classifier of whether that tier answers a request
right, saved as a small JSON file (no pickle: a router file from elsewhere is data, never code).

    {"format": "jaxserve-cascade-router", "version": 1,
     "tiers": ["<served name of tier 0>", ..., "<tier n-1>"],
     "before": [clf for tier 0, ..., clf for tier n-2],   # optional: route before generating (prompt features)
     "after":  [clf ..., ...],                             # optional: escalate after generating (prompt + answer)
     "trained_on": {...free-form provenance...}}
    clf = {"features": [names], "mean": [...], "scale": [...], "weights": [...], "bias": b, "threshold": t}

A classifier gives p = sigmoid(bias + sum(w * (x - mean) / scale)) = P(this tier's answer is right), x the features
of the request under *that tier's own model* (`jaxserve.cascade.features`); the tier keeps the request when
p >= threshold, else it moves up a tier, and the last tier always answers. "before" classifiers read prompt features
only (PROMPT_FEATURES), "after" ones prompt and answer features.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxserve.cascade.features import ANSWER_FEATURES, PROMPT_FEATURES

FORMAT = "jaxserve-cascade-router"
VERSION = 1
POLICIES = ("before", "after")
# The features each policy's classifiers may read: before generating there is no answer yet.
POLICY_FEATURES = {"before": PROMPT_FEATURES, "after": PROMPT_FEATURES + ANSWER_FEATURES}
_CLASSIFIER_FIELDS = ("features", "mean", "scale", "weights", "bias", "threshold")
_FILE_FIELDS = ("format", "version", "tiers", *POLICIES, "trained_on")


class RouterFileError(ValueError):
    """A router file that cannot be used; the message names the file and the field."""


class _Invalid(ValueError):
    """A bad field of a classifier or router (field: its path within the file, as `before[0].scale[1]`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclasses.dataclass(frozen=True)
class TierClassifier:
    """Logistic regression over named features, standardised by (x - mean) / scale: P(the tier answers right)."""
    features: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    threshold: float

    def __post_init__(self):
        for name in ("features", "mean", "scale", "weights"):  # lists (as JSON gives them) become tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.features:
            raise _Invalid("features", "a classifier needs at least one feature")
        for i, name in enumerate(self.features):
            if not isinstance(name, str) or name not in POLICY_FEATURES["after"]:
                raise _Invalid(f"features[{i}]", f"unknown feature {name!r} (known: "
                                                 f"{', '.join(POLICY_FEATURES['after'])})")
        repeated = sorted({f for f in self.features if self.features.count(f) > 1})
        if repeated:
            raise _Invalid("features", f"{', '.join(repeated)} given more than once")
        for name in ("mean", "scale", "weights"):
            values = getattr(self, name)
            if len(values) != len(self.features):
                raise _Invalid(name, f"{len(values)} values for {len(self.features)} features")
            for i, v in enumerate(values):
                _check_number(v, f"{name}[{i}]")
                if name == "scale" and not v > 0:
                    raise _Invalid(f"scale[{i}]", f"must be > 0, got {v}")
        _check_number(self.bias, "bias")
        _check_threshold(self.threshold, "threshold")

    def probability(self, features: dict[str, float]) -> float:
        """P(right) for a request's features (a dict holding at least this classifier's)."""
        missing = [f for f in self.features if f not in features]
        if missing:
            raise ValueError(f"the classifier reads {', '.join(missing)}, which the features given lack")
        z = self.bias + sum(w * (features[f] - m) / s
                            for f, m, s, w in zip(self.features, self.mean, self.scale, self.weights))
        if math.isnan(z):  # features of opposite infinities (a token of probability 0): nothing sure, move up
            return 0.0
        # sigmoid, written so that neither branch overflows exp
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    def keeps(self, features: dict[str, float], threshold: float | None = None) -> bool:
        """Whether the tier answers the request itself: P(right) >= threshold (this classifier's unless given)."""
        return self.probability(features) >= (self.threshold if threshold is None else threshold)

    def to_json(self) -> dict:
        return {"features": list(self.features), "mean": list(self.mean), "scale": list(self.scale),
                "weights": list(self.weights), "bias": self.bias, "threshold": self.threshold}


@dataclasses.dataclass(frozen=True)
class CascadeRouter:
    """The tiers (served model names, cheapest first) and each policy's classifiers (one per tier but the last;
    None: the file has no classifiers for that policy)."""
    tiers: tuple[str, ...]
    before: tuple[TierClassifier, ...] | None = None
    after: tuple[TierClassifier, ...] | None = None
    trained_on: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if len(self.tiers) < 2:
            raise _Invalid("tiers", f"a cascade needs at least 2 tiers, got {len(self.tiers)}")
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, str) or not tier:
                raise _Invalid(f"tiers[{i}]", f"must be a served model's name (a non-empty string), got {tier!r}")
        repeated = sorted({t for t in self.tiers if self.tiers.count(t) > 1})
        if repeated:
            raise _Invalid("tiers", f"{', '.join(repeated)} given more than once")
        if self.before is None and self.after is None:
            raise _Invalid("before", "a router needs classifiers for at least one policy (before or after)")
        for policy in POLICIES:
            classifiers = getattr(self, policy)
            if classifiers is None:
                continue
            classifiers = tuple(classifiers)
            object.__setattr__(self, policy, classifiers)
            if len(classifiers) != len(self.tiers) - 1:
                raise _Invalid(policy, f"{len(classifiers)} classifiers for {len(self.tiers)} tiers: one per tier "
                                       f"but the last ({len(self.tiers) - 1})")
            for i, clf in enumerate(classifiers):
                allowed = POLICY_FEATURES[policy]
                for j, name in enumerate(clf.features):
                    if name not in allowed:
                        raise _Invalid(f"{policy}[{i}].features[{j}]", f"{name!r} is an answer feature: a "
                                                                       f"{policy} classifier reads prompt features "
                                                                       f"only ({', '.join(allowed)})")
        if not isinstance(self.trained_on, dict):
            raise _Invalid("trained_on", "must be an object")

    def classifiers(self, policy: str) -> tuple[TierClassifier, ...]:
        """The policy's classifiers, or ValueError if the router has none."""
        if policy not in POLICIES:
            raise ValueError(f"unknown cascade policy {policy!r} (before or after)")
        classifiers = getattr(self, policy)
        if classifiers is None:
            raise ValueError(f"the router has no {policy!r} classifiers (it has: "
                             f"{', '.join(p for p in POLICIES if getattr(self, p) is not None)})")
        return classifiers

    def with_threshold(self, threshold: float) -> "CascadeRouter":
        """The same router with every classifier's threshold set to `threshold` (a point on the quality/cost
        curve: higher keeps fewer requests on the cheaper tiers)."""
        _check_threshold(threshold, "threshold")
        return dataclasses.replace(self, **{
            policy: tuple(dataclasses.replace(c, threshold=threshold) for c in getattr(self, policy))
            for policy in POLICIES if getattr(self, policy) is not None})

    def to_json(self) -> dict:
        body = {"format": FORMAT, "version": VERSION, "tiers": list(self.tiers)}
        for policy in POLICIES:
            if getattr(self, policy) is not None:
                body[policy] = [c.to_json() for c in getattr(self, policy)]
        body["trained_on"] = self.trained_on
        return body

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path) -> "CascadeRouter":
        """The router in a file, or RouterFileError naming the file and the field that is wrong."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise RouterFileError(f"router file {path}: cannot be read: {e}") from None
        try:
            body = json.loads(text)
        except ValueError as e:
            raise RouterFileError(f"router file {path}: not JSON: {e}") from None
        try:
            return cls.from_json(body)
        except _Invalid as e:
            raise RouterFileError(f"router file {path}: {e.field}: {e.message}") from None

    @classmethod
    def from_json(cls, body) -> "CascadeRouter":
        """A router from a router file's parsed JSON; ValueError (`_Invalid`: its field) if it is not one."""
        if not isinstance(body, dict):
            raise _Invalid("(top level)", f"must be an object, got {type(body).__name__}")
        unknown = [k for k in body if k not in _FILE_FIELDS]
        if unknown:
            raise _Invalid(unknown[0], f"unknown field (known: {', '.join(_FILE_FIELDS)})")
        if body.get("format") != FORMAT:
            raise _Invalid("format", f"must be {FORMAT!r}, got {body.get('format')!r}")
        if body.get("version") != VERSION or isinstance(body.get("version"), bool):
            raise _Invalid("version", f"must be {VERSION} (this jaxserve reads version {VERSION}), got "
                                      f"{body.get('version')!r}")
        tiers = body.get("tiers")
        if not isinstance(tiers, list):
            raise _Invalid("tiers", f"must be a list of served model names, got {type(tiers).__name__}")
        policies = {}
        for policy in POLICIES:
            if body.get(policy) is None:
                policies[policy] = None
                continue
            if not isinstance(body[policy], list):
                raise _Invalid(policy, f"must be a list of classifiers, got {type(body[policy]).__name__}")
            policies[policy] = tuple(_classifier(c, f"{policy}[{i}]") for i, c in enumerate(body[policy]))
        return cls(tiers=tuple(tiers), trained_on=body.get("trained_on", {}), **policies)


def _classifier(body, where: str) -> TierClassifier:
    if not isinstance(body, dict):
        raise _Invalid(where, f"must be an object, got {type(body).__name__}")
    unknown = [k for k in body if k not in _CLASSIFIER_FIELDS]
    if unknown:
        raise _Invalid(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(_CLASSIFIER_FIELDS)})")
    missing = [k for k in _CLASSIFIER_FIELDS if k not in body]
    if missing:
        raise _Invalid(f"{where}.{missing[0]}", "missing")
    for name in ("features", "mean", "scale", "weights"):
        if not isinstance(body[name], list):
            raise _Invalid(f"{where}.{name}", f"must be a list, got {type(body[name]).__name__}")
    try:
        return TierClassifier(**{k: body[k] for k in _CLASSIFIER_FIELDS})
    except _Invalid as e:
        raise _Invalid(f"{where}.{e.field}", e.message) from None


def _check_number(v, field: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Invalid(field, f"must be a finite number, got {v!r}")


def _check_threshold(v, field: str) -> None:
    _check_number(v, field)
    if not 0 <= v <= 1:
        raise _Invalid(field, f"must be a probability in [0, 1], got {v}")
