"""The routing decision of a cascade, as plain functions over "what tier i says about the request" callables: the
server passes ones that run its engines, tests pass fakes.

Both policies walk the tiers cheapest first and differ only in what a tier is asked:
- before: tier i scores the prompt (one scoring pass: its prompt features), before anything is generated;
- after: tier i answers, and its answer's features (with its prompt's) are judged.
A tier keeps the request when its classifier keeps every one of the request's items (its prompts, or its answers'
choices); else the request moves up a tier. The last tier answers whatever it would say: it is never asked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Awaitable, Callable, Protocol, Sequence

from jaxserve.cascade.router_file import POLICIES, CascadeRouter


class Judge(Protocol):
    """What decides whether a tier keeps a request: a TierClassifier, or `ConfidenceRule`."""
    features: tuple[str, ...]
    threshold: float

    def probability(self, features: dict[str, float]) -> float: ...


@dataclasses.dataclass(frozen=True)
class ConfidenceRule:
    """The after policy without a trained router: a tier keeps its answer when the answer's per-token probability
    (the geometric mean, exp(mean token logprob)) is at least `threshold`."""
    threshold: float
    features: tuple[str, ...] = ("answer_mean_logprob",)

    def __post_init__(self):
        if not (isinstance(self.threshold, (int, float)) and 0 <= self.threshold <= 1):
            raise ValueError(f"a confidence threshold is a per-token probability in [0, 1], got {self.threshold!r}")

    def probability(self, features: dict[str, float]) -> float:
        return math.exp(features["answer_mean_logprob"])


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a request went: the tier that answers, and what each tier below it (and the answering one, if it was
    asked) said, cheapest first: the probability it gave (the lowest over the request's items), or None for a tier
    that was skipped, not asked (one that cannot take the request: too long for its max_model_len)."""
    tier: int
    probabilities: tuple[float | None, ...] = ()

    @property
    def escalations(self) -> list[tuple[int, int]]:
        """Each move up from a tier that was asked and did not keep the request, (from, to): to the next tier asked,
        or the answering one. A tier skipped, or a request sent straight to the last tier (never judged), is no
        escalation."""
        refused = [i for i, p in enumerate(self.probabilities[:self.tier]) if p is not None]
        return list(zip(refused, [*refused[1:], self.tier]))


async def choose_tier(judges: Sequence[Judge],
                      features_of: Callable[[int], Awaitable[list[dict[str, float]] | None]]) -> Route:
    """The first tier whose judge keeps every item `features_of(tier)` gives (one feature dict per prompt or per
    answer), trying tiers 0, 1, ... in turn; len(judges) (the last tier, never asked) if none does. features_of
    gives None for a tier that cannot take the request: it is skipped (moved past, not judged). Deterministic: the
    same features give the same route."""
    probabilities: list[float | None] = []
    for tier, judge in enumerate(judges):
        items = await features_of(tier)
        if items is None:
            probabilities.append(None)
            continue
        if not items:
            raise ValueError(f"tier {tier} gave no features to judge")
        p = min(judge.probability(f) for f in items)
        probabilities.append(p)
        if p >= judge.threshold:
            return Route(tier, tuple(probabilities))
    return Route(len(judges), tuple(probabilities))


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """A cascade as the command line asks for it (`jaxserve serve --cascade A,B ...`), checked before any model
    loads. policy None: "before" if the router has before classifiers, else "after". threshold: every classifier's
    threshold instead of the file's (the after policy without a router file: the `ConfidenceRule`'s, required)."""
    tiers: tuple[str, ...]
    name: str = "auto"
    policy: str | None = None
    router: CascadeRouter | None = None
    threshold: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("--cascade-name must not be empty")
        if len(self.tiers) < 2:
            raise ValueError(f"--cascade needs at least 2 tiers (served model names, cheapest first, separated by "
                             f"commas), got {','.join(self.tiers) or 'none'}")
        if any(not t for t in self.tiers):
            raise ValueError(f"--cascade {','.join(self.tiers)}: a tier name is empty")
        repeated = sorted({t for t in self.tiers if self.tiers.count(t) > 1})
        if repeated:
            raise ValueError(f"--cascade names {', '.join(map(repr, repeated))} more than once")
        if self.name in self.tiers:
            raise ValueError(f"--cascade-name {self.name!r} is one of its tiers: the cascade needs a name of its own")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"--cascade-policy must be before or after, got {self.policy!r}")
        if self.threshold is not None and not (isinstance(self.threshold, (int, float)) and
                                               0 <= self.threshold <= 1):
            raise ValueError(f"--cascade-threshold must be a probability in [0, 1], got {self.threshold}")
        if self.router is None:
            if self.policy == "before":
                raise ValueError("--cascade-policy before routes by a trained router's classifiers: give "
                                 "--router-file")
            if self.threshold is None:
                raise ValueError("a cascade without --router-file escalates when an answer's per-token probability "
                                 "is below --cascade-threshold: give --cascade-threshold (or --router-file)")
            object.__setattr__(self, "policy", "after")
            return
        if self.router.tiers != self.tiers:
            raise ValueError(f"the router file is for the tiers {','.join(self.router.tiers)}, not --cascade "
                             f"{','.join(self.tiers)}")
        if self.policy is None:
            object.__setattr__(self, "policy", "before" if self.router.before is not None else "after")
        if getattr(self.router, self.policy) is None:
            raise ValueError(f"--cascade-policy {self.policy}: the router file has no {self.policy!r} classifiers")
        if self.threshold is not None:
            object.__setattr__(self, "router", self.router.with_threshold(self.threshold))

    def judges(self) -> tuple[Judge, ...]:
        """The policy's judge for each tier but the last."""
        if self.router is None:
            return (ConfidenceRule(self.threshold),) * (len(self.tiers) - 1)
        return self.router.classifiers(self.policy)

    def stream_judges(self) -> tuple[Judge, ...] | None:
        """How a streaming request is routed: a stream cannot take back what it sent, so under the after policy it
        is routed before generating, by the router's before classifiers if it has them, else (None) to the last
        tier."""
        if self.policy == "before":
            return self.judges()
        return self.router.before if self.router is not None else None

    def reads(self) -> set[str]:
        """The features the policy's judges read."""
        return {name for judge in self.judges() for name in judge.features}
