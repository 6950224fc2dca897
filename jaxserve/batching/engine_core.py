"""The engine loop: plan step N+1 and dispatch it, then read back step N's tokens while N+1 runs.

JAX dispatch is asynchronous, so the device never waits for the host between steps: step N+1 is planned before
step N's tokens are known (its decode rows take their input tokens from the device), and the host's per-token work
(detokenizing, stop strings, streaming) for step N overlaps the device's work on N+1. The price: a sequence that
stops at step N was also given a row in step N+1, whose token is dropped.
"""
from __future__ import annotations

import dataclasses
import time

from jaxserve.batching.model_runner import ModelRunner
from jaxserve.batching.scheduler import Scheduler, StepPlan
from jaxserve.batching.sequence import Sequence, Status


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    kv_cache_usage: float  # fraction of pages held by sequences (evictable prefix pages count as free)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (prefix hits excluded)
    generation_tokens: int
    generation_tokens_per_s: float  # over the last few seconds
    steps: int


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, rate_window_s: float = 5.0):
        self.scheduler = scheduler
        self.runner = runner
        self._in_flight: tuple[StepPlan, tuple] | None = None
        self._last_arrival: float | None = None
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._rate_window_s = rate_window_s
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps, for tokens/s

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        return self.scheduler.abort(request_id)

    def fail_running(self) -> set[str]:
        """After a failed step: the requests that had a sequence in the lost steps out (all their sequences),
        nothing in flight (its results are lost with it). Those are the running sequences and any preempted with a
        token still in flight, which will never land. Other waiting requests were in no step and stay. Returns the
        failed request ids."""
        s = self.scheduler
        failed = {q.request_id for q in s.running} | {q.request_id for q in s.waiting if q.pending}
        for request_id in failed:
            self.scheduler.abort(request_id)
        self._in_flight = None
        return failed

    def abort_all(self) -> None:
        """After a failed step: every sequence out, nothing in flight (its results are lost with it)."""
        for seq in self.scheduler.waiting + self.scheduler.running:
            self.scheduler.finish(seq)
        self._in_flight = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[tuple[Sequence, str]]:
        """Dispatches the next step and returns (sequence, new text) for each token of the previous one."""
        plan = self.scheduler.schedule()
        dispatched = self._dispatch(plan) if plan else None
        done, self._in_flight = self._in_flight, dispatched
        if done is None:
            if dispatched is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler can neither run nor admit any sequence")  # a bug, never a wait
            return []
        return self._update(*done)

    def _dispatch(self, plan: StepPlan) -> tuple[StepPlan, tuple]:
        handle = self.runner.dispatch(plan)
        self.scheduler.count_in(plan)
        self.prompt_tokens += sum(c.length for c in plan.prefill)
        return plan, handle

    def _update(self, plan: StepPlan, handle: tuple) -> list[tuple[Sequence, str]]:
        out = self.runner.fetch(handle)  # the step's one blocking copy
        self.scheduler.written(plan)
        now = time.monotonic()
        if self.scheduler.slo is not None and self._last_arrival is not None:
            self.scheduler.slo.observe(len(plan.decode), now - self._last_arrival)
        self._last_arrival = now if self._in_flight is not None else None  # idle gaps are not step time
        self.steps += 1
        # Rows in the order plan_rows laid them out: decode rows, then prompt chunks.
        row_seqs = plan.decode + [c.seq for c in plan.prefill]
        changed, emitted = [], 0
        tokens, counts = out.tokens.tolist(), out.num_tokens.tolist()
        for i, seq in enumerate(row_seqs):
            if not counts[i] or seq.finished:
                continue  # a chunk short of its prompt's end; or stopped or aborted while this step ran
            seq.pending -= 1  # a row's tokens land together
            delta = []
            for j in range(counts[i]):
                top = []
                if seq.params.logprobs:
                    top = list(zip(out.top_ids[i, j].tolist(), out.top_logprobs[i, j].tolist()))
                delta.append(seq.append_token(tokens[i][j], float(out.logprobs[i, j]), int(out.ranks[i, j]), top))
                emitted += 1
                if seq.finish_reason is not None:
                    break  # never a token past a stop
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.finish_reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq)
            changed.append((seq, "".join(delta)))
        self.generation_tokens += emitted
        self._recent = [(t, n) for t, n in self._recent if now - t <= self._rate_window_s] + [(now, emitted)]
        return changed

    def stats(self) -> EngineStats:
        cache, s = self.scheduler.cache, self.scheduler
        total = cache.allocator.num_usable
        used = total - cache.num_available
        span = self._recent[-1][0] - self._recent[0][0] if len(self._recent) > 1 else 0.0
        rate = sum(n for _, n in self._recent[1:]) / span if span > 0 else 0.0
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), pages_used=used, pages_total=total,
            kv_cache_usage=used / total, prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
            prefix_cache_hit_rate=cache.hit_rate(), num_preemptions=s.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            generation_tokens_per_s=rate, steps=self.steps)

    def assert_idle_and_clean(self) -> None:
        """For tests: nothing queued, nothing in flight, no page held by anyone but the prefix cache."""
        assert not self.has_unfinished()
        cache = self.scheduler.cache
        assert cache.num_available == cache.allocator.num_usable, "a page is still held"
        assert sorted(self.scheduler._free_slots) == list(range(self.scheduler.max_num_seqs))
        assert all(s.status is not Status.RUNNING for s in self.scheduler.waiting)
