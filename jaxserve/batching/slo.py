"""Sizing the running batch from measured step times, to hold latency targets.

A bigger batch decodes more tokens per weight read (throughput) but every step takes longer (TPOT); a smaller one
leaves requests waiting (TTFT). With a TPOT target, the cap on running sequences is the largest batch bucket whose
measured step time meets it, growing one bucket at a time to measure the next (like TCP slow start). With a TTFT
target too, a queue whose oldest request has used half its TTFT budget (TTFT at risk) lifts the cap, and the
scheduler keeps part of the step's token budget for its prompt even where the decodes would take it all (some
decodes then wait a step): admitting it is worth slower steps for everyone already running.
"""
from __future__ import annotations

import time

from jaxserve.buckets import round_up


class SloController:
    def __init__(self, batch_buckets: tuple[int, ...], max_num_seqs: int, tpot_slo: float | None = None,
                 ttft_slo: float | None = None, smoothing: float = 0.3, stale_after: int = 200):
        for name, value in (("tpot_slo", tpot_slo), ("ttft_slo", ttft_slo)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.buckets = tuple(b for b in batch_buckets if b <= max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.tpot_slo = tpot_slo
        self.ttft_slo = ttft_slo
        self.smoothing = smoothing
        # A size over the target stops being run, so its time would never be measured again: after stale_after
        # steps it is probed afresh (loads change; one slow step must not cap the batch for good).
        self.stale_after = stale_after
        self.step_seconds: dict[int, float] = {}  # decode batch bucket -> smoothed step time
        self._measured_at: dict[int, int] = {}  # decode batch bucket -> observation count when last measured
        self._observations = 0

    def observe(self, num_decoded: int, seconds: float) -> None:
        """One step's time, between consecutive result arrivals: what each decoding sequence waited for a token."""
        if num_decoded == 0:
            return
        b = round_up(num_decoded, self.buckets)
        self._observations += 1
        old = self.step_seconds.get(b) if self._fresh(b) else None
        self.step_seconds[b] = seconds if old is None else old + self.smoothing * (seconds - old)
        self._measured_at[b] = self._observations

    def _fresh(self, b: int) -> bool:
        return b in self.step_seconds and self._observations - self._measured_at[b] <= self.stale_after

    def ttft_at_risk(self, waiting, now: float | None = None) -> bool:
        """The oldest waiting request has used half its TTFT budget."""
        if self.ttft_slo is None or not waiting:
            return False
        now = time.monotonic() if now is None else now
        return now - min(s.arrival_time for s in waiting) > self.ttft_slo / 2

    def batch_cap(self, waiting, now: float | None = None) -> int:
        """How many sequences may run now."""
        if self.ttft_at_risk(waiting, now):
            return self.max_num_seqs
        if self.tpot_slo is None:
            return self.max_num_seqs
        cap = self.buckets[0]
        for i, b in enumerate(self.buckets):
            if self._fresh(b):
                if self.step_seconds[b] > self.tpot_slo:
                    return cap
            elif not any(self._fresh(x) for x in self.buckets[i + 1:]):
                return b  # nothing known from here up: the next size to try
            cap = b
        return cap
