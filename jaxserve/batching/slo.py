"""Sizing the running batch from measured step times, to hold latency targets.

A bigger batch decodes more tokens per weight read (throughput) but every step takes longer (TPOT); a smaller one
leaves requests waiting (TTFT). With a TPOT target, the cap on running sequences is the largest batch bucket whose
measured step time meets it, growing one bucket at a time to measure the next (like TCP slow start). With a TTFT
target too, a queue whose oldest request has used half its TTFT budget lifts the cap: then admitting it is worth
slower steps for everyone already running.
"""
from __future__ import annotations

import time

from jaxserve.buckets import round_up


class SloController:
    def __init__(self, batch_buckets: tuple[int, ...], max_num_seqs: int, tpot_slo: float | None = None,
                 ttft_slo: float | None = None, smoothing: float = 0.3):
        for name, value in (("tpot_slo", tpot_slo), ("ttft_slo", ttft_slo)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.buckets = tuple(b for b in batch_buckets if b <= max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.tpot_slo = tpot_slo
        self.ttft_slo = ttft_slo
        self.smoothing = smoothing
        self.step_seconds: dict[int, float] = {}  # decode batch bucket -> smoothed step time

    def observe(self, num_decoded: int, seconds: float) -> None:
        """One step's time, between consecutive result arrivals: what each decoding sequence waited for a token."""
        if num_decoded == 0:
            return
        b = round_up(num_decoded, self.buckets)
        old = self.step_seconds.get(b)
        self.step_seconds[b] = seconds if old is None else old + self.smoothing * (seconds - old)

    def batch_cap(self, waiting, now: float | None = None) -> int:
        """How many sequences may run now."""
        now = time.monotonic() if now is None else now
        if self.ttft_slo is not None and waiting:
            oldest = now - min(s.arrival_time for s in waiting)
            if oldest > self.ttft_slo / 2:
                return self.max_num_seqs
        if self.tpot_slo is None:
            return self.max_num_seqs
        cap = self.buckets[0]
        for b in self.buckets:
            measured = self.step_seconds.get(b)
            if measured is None:
                return b  # the next size to try
            if measured > self.tpot_slo:
                return cap
            cap = b
        return cap
