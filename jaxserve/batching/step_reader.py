"""Reading a step back and applying it, and the bookkeeping around it: the output processor cuts each row's tokens
at any stop, the scheduler takes them in; what the read-back shows of the step's time feeds the step clock (when to
plan the next step: `jaxserve.batching.step_timing`), the SLO controller (`jaxserve.batching.slo`) and the
speculation controller; the counts feed the replica's stats.

`StepReader` is the base of `jaxserve.batching.engine_core.EngineCore`: the state the loop and its read-back share
(the step in flight, the timings, the counters) and the read-back itself.
"""
from __future__ import annotations

import time

from jaxserve.batching import output_processor
from jaxserve.batching.engine_stats import StepCounters
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.sequence import Status
from jaxserve.batching.speculation.controller import SpecController
from jaxserve.batching.step_timing import InFlight, StepClock
from jaxserve.runner.protocol import Runner


class StepReader:
    def __init__(self, scheduler: Scheduler, runner: Runner, controller: SpecController | None, adaptive: bool,
                 rate_window_s: float):
        self.scheduler = scheduler
        self.runner = runner
        self.controller, self.adaptive = controller, adaptive
        self._in_flight: InFlight | None = None
        self._last_fetch: float | None = None  # when the last step followed by another at once was read back
        self._fetch_wait = 0.0  # how long the last read-back waited for the device
        self._last_arrival: float | None = None
        self.clock = StepClock()  # when a server plans the next step with async scheduling (`wait_in_flight`)
        self.counters = StepCounters(rate_window_s)
        self._changed: list[SequenceDelta] = []  # what the current step has read back so far
        self.failed_steps = 0  # in a row: reset when a sequence decodes past its first token or finishes

    def _read_back(self, timed: bool = False) -> None:
        """Reads the step in flight back before the next is planned. timed: every step is planned so (no async
        scheduling), so the time since the last read-back is one step's, as a token waits for it; otherwise this
        step alone gives up the overlap and its time is no pipelined step's."""
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None  # its results are lost with it if reading it fails
            self._update(done, timed)
            now = time.perf_counter()
            if timed and self.adaptive and self.controller is not None and self._last_fetch is not None:
                self.controller.observe_step(done.batch.num_tokens, now - self._last_fetch, False)
            self._last_fetch = now if timed else None
        else:
            self._last_fetch = None

    def _read_back_behind(self, done: InFlight, start: float, follows: bool) -> None:
        """Reads back `done`, the step before the one just dispatched (async scheduling: the host's work on it
        overlaps the device's on the next); start: when this step's host work began. follows: a step is in flight
        now, so the time to the next read-back is a step's."""
        self._update(done)
        now = time.perf_counter()
        if self.adaptive and self.controller is not None:
            self.controller.observe_host(len(done.batch.rows), now - start - self._fetch_wait)
            if self._last_fetch is not None:
                self.controller.observe_step(done.batch.num_tokens, now - self._last_fetch, False)
        self._last_fetch = now if follows else None

    def _update(self, done: InFlight, next_follows: bool = False) -> None:
        """Reads a step back and applies it; what it added joins the step's results only once applied whole (a
        failure later in this step must not lose it). next_follows: the next step is planned right after (no async
        scheduling), so the time to the next read-back is a step's even with nothing in flight now."""
        wait = time.perf_counter()
        out = self.runner.fetch(done.handle)  # the step's one blocking copy
        read_back = time.perf_counter()
        self._fetch_wait = read_back - wait
        self.clock.read_back(done, self._fetch_wait, read_back)
        batch = done.batch
        now = time.monotonic()
        if self.scheduler.slo is not None and self._last_arrival is not None:
            self.scheduler.slo.observe(len(batch.decode), now - self._last_arrival)
        # Idle gaps are not step time.
        self._last_arrival = now if self._in_flight is not None or next_follows else None
        self.counters.steps += 1
        deltas = output_processor.process(batch.row_seqs, out, batch.rows)
        for d in deltas:
            if batch.proposals.get(d.seq):
                assert self.controller is not None  # proposals come only with speculation, which has one
                self.controller.observe(d.seq, len(batch.proposals[d.seq]), d.num_emitted - 1)
        self.scheduler.update(batch, deltas, now)
        if any(d.finished or len(d.seq.output_token_ids) > 1 or d.seq.status is Status.HANDED_OFF for d in deltas):
            # This replica serves: a sequence decoded past its first token, finished, or was handed off (all a
            # prefill engine does). A prefill alone (elsewhere) proves
            # little: every new request's succeeds while a broken decode fails each one after it.
            self.failed_steps = 0
        self._changed += deltas
        self.counters.generated(now, sum(len(d.token_ids) for d in deltas))
