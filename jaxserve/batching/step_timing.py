"""When to plan the next step, with async scheduling: as the step in flight is about to end.

A server's loop calls `EngineCore.wait_in_flight` before it takes new requests in, and that returns at `plan_at`:
the step in flight's predicted end less the host's measured time to plan and dispatch a step (times a factor, plus a
margin: the plan lead). So a request that arrives while step N runs joins N+1 unless it comes in those last moments,
and the device still goes from N to N+1 without waiting. What predicts a step's time is its shape (tokens, rows), and
each shape's time is a moving average of the steps seen to end: waited for, or read back as they ended.
"""
from __future__ import annotations

import dataclasses

from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.runner.protocol import StepHandle


@dataclasses.dataclass
class InFlight:
    """A step dispatched and not yet read back."""
    batch: ScheduledBatch
    handle: StepHandle
    dispatched: float  # time.perf_counter() when its dispatch returned
    ended: float | None = None  # when a wait saw it end (wait_in_flight), if one did
    reads_back_first: bool = False  # the next step is planned only once this one is read back (engine_core)


def step_shape(batch: ScheduledBatch) -> tuple[int, int]:
    """What a step's time is predicted by: its tokens and rows."""
    return batch.num_tokens, len(batch.rows)


def moving_average(old: float | None, new: float) -> float:
    """A moving average that follows a drifting time (a row's context grows each step) within a few steps."""
    return new if old is None else 0.5 * (old + new)


class StepClock:
    """Seconds a step of each shape took on the device, and the host's to plan and dispatch one (moving
    averages), and when the last step read back ended: what `plan_at` predicts from."""

    def __init__(self):
        self.step_seconds: dict[tuple[int, int], float] = {}
        self.plan_seconds: float | None = None
        self.ended_at: float | None = None  # when the last step read back ended (or was read back)

    def planned(self, seconds: float) -> None:
        """The host planned and dispatched a step in `seconds`."""
        self.plan_seconds = moving_average(self.plan_seconds, seconds)

    def read_back(self, done: InFlight, fetch_wait: float, read_back: float) -> None:
        """`done` was read back at `read_back` (time.perf_counter()), its copy having waited fetch_wait seconds for
        the device. Its end, if seen (waited for, or read back as it ended), times its shape: it ran from when it
        could start until then."""
        ended = done.ended if done.ended is not None else read_back if fetch_wait > 1e-4 else None
        if ended is not None:
            key = step_shape(done.batch)
            start = max(done.dispatched, self.ended_at or 0.0)
            self.step_seconds[key] = moving_average(self.step_seconds.get(key), ended - start)
        self.ended_at = ended or read_back

    def plan_at(self, f: InFlight | None, plan_lead: tuple[float, float] | None) -> float | None:
        """When to plan the next step (time.perf_counter()): the end predicted for `f` less the host's time to plan
        and dispatch one (plan_lead: a factor of that time, and seconds more); None: once it has run (not timed
        yet, read back first, or nothing in flight)."""
        if f is None:
            return None
        seconds = self.step_seconds.get(step_shape(f.batch))
        if seconds is None or self.plan_seconds is None or f.reads_back_first or plan_lead is None:
            return None
        start = max(f.dispatched, self.ended_at or 0.0)  # it runs once the step before it has
        factor, slack = plan_lead
        return start + seconds - (factor * self.plan_seconds + slack)
