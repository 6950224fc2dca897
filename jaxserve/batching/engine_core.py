"""The engine loop: plan a step, dispatch it, read the one before back. Two orders (`async_scheduling`):

On (vLLM's async scheduling): step N+1 is planned and dispatched before step N is read back, so the device never
waits for the host between steps: N+1's decode rows take their input tokens from the device, and the host's
per-token work for step N (reading back, stop strings, detokenizing) overlaps the device's work on N+1. The price: a
sequence that stops at step N was also given a row in step N+1, whose token is dropped. When N+1 is planned is the
caller's: stepping at once (offline generation, where every request is there from the start) plans it as soon as N
is dispatched, so a request that arrives while N runs would join N+2; a server's loop first calls `wait_in_flight`,
which returns only as N is about to end (N's predicted end less the host's measured time to plan and dispatch a
step), so such a request joins N+1 unless it comes in those last moments, and the device still goes from N to N+1
without waiting.
Off: step N is read back, then N+1 planned (with the requests that arrived while N ran: a server's loop calls
`wait_in_flight` before it takes them in) and dispatched; the device idles while the host reads N back (stop
checks, detokenizing) and plans N+1 (on CPU ~2 ms of a 15 ms batch-1 step: BENCHMARKS.md, issue 28), and a
request's first token comes with the step after its arrival. The host's work of streaming step N's tokens out
still overlaps step N+1.

A speculative step (proposals to verify) is the exception: its proposals must continue the latest tokens and the
plan after it must know how many were accepted, so it reads the step before back first and is waited for itself.

Structured output: a row under a grammar may sample only what its grammar allows after its latest token, so its
mask cannot be filled before that token is known. The step is split instead (`Runner.splits_sampling`): step N+1's
forward is dispatched at once, its constrained rows' input tokens chained on device as any other's; then step N is
read back, the matchers advance on its tokens, the masks of N+1's constrained rows are filled
(`jaxserve.batching.step_rows.masks_after_read_back`) and joined on device with the rows' own, and N+1's rows
sample. The device runs N+1's forward while the host reads N back and fills the masks, so a constrained batch keeps
the overlap. A runner that cannot split (over a mesh, several processes) plans the step after one holding a
constrained row only once that one is read back (as a speculative step does), losing the overlap. Constrained rows
never speculate; the others of the batch may.

Disaggregated prefill: a prefill engine hands its sequences off with their KV pages (`take_handed_off`), a decode
engine takes them in (`add_prefilled`) and writes their pages before the step that first reads them; see
`jaxserve.batching.kv_handoff`. When a server plans the next step with async scheduling:
`jaxserve.batching.step_timing`; reading a step back and what it feeds: `jaxserve.batching.step_reader`.

The host KV tier (`kv_offloading_size`): the pages a plan evicts are stored in host memory and those it finds there
loaded, before its step is dispatched (`jaxserve.batching.host_swap`).

A step that fails ends only the requests it held, and the results read back before it failed still reach theirs
(`StepError`); a replica whose steps keep failing stops (`healthy`) and ends every request it holds.
"""
from __future__ import annotations

import time

from jaxserve.batching import output_processor
from jaxserve.batching.engine_stats import EngineStats, replica_stats
from jaxserve.batching.host_swap import HostSwap
from jaxserve.batching.kv_handoff import HandOff, KVTransfers, copy_in, export_handed_off, is_ready, write_imports
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.sequence import Sequence, Status
from jaxserve.batching.speculation.controller import SpecController
from jaxserve.batching.speculation.proposer import Proposer
from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.batching.step_reader import StepReader
from jaxserve.batching.step_rows import masks_after_read_back
from jaxserve.batching.step_timing import InFlight
from jaxserve.cache.host_tier import HostTier
from jaxserve.cache.transfer import KVPages
from jaxserve.runner.protocol import Runner

# Steps of one engine replica that may fail in a row before it declares itself dead instead of going on.
MAX_FAILED_STEPS = 3
# With async scheduling a server plans the next step this long before the step in flight is predicted to end: the
# host's measured time to plan and dispatch a step, times PLAN_LEAD_FACTOR, plus PLAN_LEAD_S.
PLAN_LEAD_FACTOR, PLAN_LEAD_S = 1.25, 5e-4


class EngineDeadError(RuntimeError):
    pass


class StepError(RuntimeError):
    """A step failed. `changed`: the results read back before it did, which must still reach their requests;
    `failed`: request id -> the error that ended it (its sequences are out and their pages free)."""

    def __init__(self, cause: BaseException, changed: list[SequenceDelta], failed: dict[str, BaseException]):
        super().__init__(str(cause))
        self.cause, self.changed, self.failed = cause, changed, failed


def _position_dependent(seq: Sequence) -> bool:
    """Its sampling depends on the tokens before the position (penalties, bad words of several tokens), so it
    does not speculate: a verification step applies a row's controls alike at every scored position, exact at the
    first only. logit_bias and the token mask do not depend on it, so their rows speculate."""
    return seq.params.uses_penalties or bool(seq.controls.bad_words)


class EngineCore(StepReader):
    def __init__(self, scheduler: Scheduler, runner: Runner, rate_window_s: float = 5.0,
                 proposer: Proposer | None = None, controller: SpecController | None = None, adaptive: bool = True,
                 async_scheduling: bool = True,
                 plan_lead: tuple[float, float] | None = (PLAN_LEAD_FACTOR, PLAN_LEAD_S),
                 host_tier: HostTier | None = None):
        """proposer (an NgramProposer or DraftProposer) and controller: speculative decoding, off without them;
        adaptive=False speculates for every decoding sequence every step (as vLLM does). async_scheduling: plan a
        step before the one in flight is read back (see the module's docstring). plan_lead: with it, how long
        before the step in flight ends a server plans the next (`wait_in_flight`); None: a server waits for the
        step in flight to end and reads it back before it plans the next, as without async scheduling, while
        stepping at once still plans ahead. host_tier: the host KV tier (None: none), the scheduler's prefix
        cache's."""
        super().__init__(scheduler, runner, controller, adaptive, rate_window_s)
        self.proposer = proposer
        self.async_scheduling = async_scheduling
        self.plan_lead = plan_lead
        self._read_back_first = False  # a server waited for the step in flight: read it back before planning
        self._waited_at: float | None = None  # when a server's wait for the step in flight ended
        self._failed_imports: dict[str, BaseException] = {}  # request id -> why its import failed, this step
        self.transfers = KVTransfers()  # KV copies taken in (disaggregated prefill)
        self.host = None if host_tier is None else HostSwap(host_tier, runner)

    @property
    def healthy(self) -> bool:
        return self.failed_steps < MAX_FAILED_STEPS

    def add(self, seq: Sequence) -> None:
        if not self.healthy:
            raise EngineDeadError(f"this engine stopped after {self.failed_steps} failed steps in a row")
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = self.scheduler.abort(request_id)
        for seq in aborted:
            self.transfers.drop(seq)
        return aborted

    def take_handed_off(self, seqs: list[Sequence] | None = None) -> list[HandOff]:
        """The sequences the prefill scheduler has handed off (seqs: those of them; default: all), their pages'
        export dispatched; the pages are then free here. Until taken, a handed-off sequence holds its pages."""
        return export_handed_off(self.scheduler, self.runner, seqs)

    def can_take_prefilled(self, seq: Sequence) -> bool:
        """A prefilled sequence added now would be admitted as soon as its KV lands (see
        Scheduler.can_take_prefilled): what a pool checks before it moves a sequence's pages here."""
        return self.healthy and self.scheduler.can_take_prefilled(seq)

    def add_prefilled(self, seq: Sequence, kv: KVPages, num_cached: int, first_token: int | None = None,
                      logprob: float = 0.0, started: float | None = None) -> None:
        """A sequence prefilled elsewhere, with the K/V of its first num_cached tokens (kv: from `take_handed_off`
        or over the wire). It waits here until a slot and pages are free, then decodes. first_token: its first
        token, for a sequence built here (a decode server's), taken as already said; started: when its export
        began (time.perf_counter(); default now), for the transfer's seconds. Raises ValueError if it does not fit,
        or kv is not pages of this cache's layout and dtype holding num_cached tokens (nothing is then held)."""
        if not self.healthy:
            raise EngineDeadError(f"this engine stopped after {self.failed_steps} failed steps in a row")
        self.scheduler.check_fits(seq)
        kv = copy_in(self.runner, seq, kv, num_cached, self.scheduler.page_size)
        if first_token is not None:
            output_processor.take_as_said(seq, first_token, logprob)
        self.scheduler.add_prefilled(seq, num_cached, kv, first_token, lambda: is_ready(kv))
        self.transfers.add(seq, kv, time.perf_counter() if started is None else started)

    def _fail_running(self) -> set[str]:
        """After a failed step: the requests that had a sequence in the lost steps out (all their sequences),
        nothing in flight (its results are lost with it). Those are the running sequences and any preempted with a
        token still in flight, which will never land. Other waiting requests were in no step and stay, unless no
        request was in the failed step: then it was not the step that failed but the engine, and nothing here can
        run. Returns the failed request ids."""
        s = self.scheduler
        failed = {q.request_id for q in s.running} | {q.request_id for q in s.waiting if q.pending}
        if not failed or not self.healthy:
            failed |= {q.request_id for q in s.waiting}
        for request_id in failed:
            self.abort(request_id)
        self._in_flight = None
        self._last_fetch = self._last_arrival = None  # the failure's gap is no step time
        self.clock.ended_at, self._read_back_first = None, False  # the lost step may still be running
        return failed

    def abort_all(self) -> None:
        """After a failed step: every sequence out, nothing in flight (its results are lost with it)."""
        for seq in self.scheduler.waiting + self.scheduler.running + self.scheduler.handed_off:
            self.scheduler.finish(seq)
        self.transfers.landing.clear()
        self._in_flight = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self.scheduler.handed_off)

    def wait_in_flight(self) -> None:
        """Blocks until the next step should be planned, so that requests added meanwhile join it (a server's loop
        calls this before it takes new requests in). Without async scheduling: until the step in flight has run.
        With it: until that step is about to end (`plan_at`), so that the device still goes from one step to the
        next without waiting and only a request that comes in those last moments waits a step more; a step of a
        shape not yet timed, or one whose read-back must come first (a constrained row on a runner that cannot split
        a step), is waited for. With it and
        no plan_lead: until the step in flight has run, and the next step reads it back before it is planned. A
        failure is left for `step` to read back and report."""
        if self._in_flight is not None:
            self._read_back_first = self.async_scheduling and self.plan_lead is None
            self.wait_until(self.plan_at() if self.plans_just_in_time else None)

    @property
    def plans_just_in_time(self) -> bool:
        return self.async_scheduling and self.plan_lead is not None

    def plan_at(self) -> float | None:
        """When a server should plan the next step (time.perf_counter()): the step in flight's predicted end less
        the host's time to plan and dispatch one (`plan_lead`: a factor of that time, and seconds more); None:
        once it has run (not timed yet, read back first, or nothing in flight)."""
        return self.clock.plan_at(self._in_flight, self.plan_lead)

    def wait_until(self, until: float | None) -> None:
        """Blocks until the step in flight has run, or until time.perf_counter() passes `until` if given. A
        failure is left for `step` to read back and report."""
        f = self._in_flight
        if f is None:
            return
        start = time.perf_counter()
        try:
            ran = self.runner.wait(f.handle, until)
        except Exception:  # noqa: BLE001 - the step's failure: step() ends its requests, and only those
            return
        now = time.perf_counter()
        if ran and now - start > 1e-4:  # it ended while waited for: now
            f.ended = now
        self._waited_at = now  # the host's planning time counts from here

    def step(self) -> list[SequenceDelta]:
        """Dispatches the next step and returns what the previous one (and, in a speculative step, this one) added
        to each sequence. Raises StepError if it fails, with the requests it ended and what it had
        read back before; the engine is then clean for the next step."""
        self._changed, self._failed_imports = [], {}
        self.transfers.count_landed()
        if self.host is not None:
            self.host.poll()
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - any failure: its requests end, the others go on
            self.failed_steps += 1
            held = {q.request_id for q in self.scheduler.waiting + self.scheduler.running}
            try:
                failed = dict.fromkeys(self._fail_running(), e)
            except Exception:  # noqa: BLE001 - state too broken to tell: every request ends, none hangs
                failed = dict.fromkeys(held, e)
                self.abort_all()
            if not self.healthy:
                dead = EngineDeadError(f"the engine stopped after {self.failed_steps} failed steps in a row: {e}")
                failed = dict.fromkeys(failed, dead)
            raise StepError(e, self._changed, {**self._failed_imports, **failed}) from e
        if self._failed_imports:  # the step ran without them
            raise StepError(next(iter(self._failed_imports.values())), self._changed, self._failed_imports)
        return self._changed

    def _step(self) -> None:
        start = time.perf_counter()
        read_back_first, self._read_back_first = self._read_back_first, False
        waited_at, self._waited_at = self._waited_at, None
        if self.proposer is not None:
            lengths = self._speculation_lengths()
            if lengths:
                return self._speculative_step(lengths)
            _, controller = self._speculation()
            controller.num_speculating = 0
        if self._in_flight is not None and (self._in_flight.reads_back_first or not self.async_scheduling
                                            or read_back_first):
            self._read_back(timed=not self.async_scheduling or read_back_first)
        planning = waited_at or time.perf_counter()  # a server's from the end of its wait (new requests taken in)
        batch = self.scheduler.schedule()
        if not batch and self._in_flight is None and self.scheduler.awaits_kv():
            # Nothing to run but sequences whose KV is still landing: wait for it here rather than spin.
            self.transfers.wait()
            batch = self.scheduler.schedule()
        self._import(batch)
        dispatched = self._dispatch(batch) if batch else None
        if dispatched is not None:
            self.clock.planned(dispatched.dispatched - planning)
        done, self._in_flight = self._in_flight, dispatched
        if done is None:
            self._join_masks(dispatched)
        if dispatched is None and self.host is not None:  # nothing more to run: its copies land now, not when polled
            self.host.poll(wait=True)
        if done is None:
            if dispatched is None:  # idle from here: the gap to the next read-back is no step's time
                self._last_fetch = self._last_arrival = None
            # Handed-off sequences not yet taken hold their pages: waiting ones may wait for them.
            if dispatched is None and self.scheduler.has_unfinished() and not self.scheduler.handed_off \
                    and not self._failed_imports:
                raise RuntimeError("the scheduler can neither run nor admit any sequence")  # a bug, never a wait
            return
        self._read_back_behind(done, start, dispatched is not None)
        self._join_masks(dispatched)  # the matchers now stand after the tokens its rows take as input

    def _join_masks(self, dispatched: InFlight | None) -> None:
        """A split step's rows sampled, under the grammar masks filled now (module docstring)."""
        if dispatched is not None and dispatched.batch.masks_later:
            self.runner.join_masks(dispatched.handle, masks_after_read_back(dispatched.batch))

    def _speculation_lengths(self) -> dict[Sequence, int]:
        """Proposals wanted per decoding sequence. Decided on what the host knows: a token still in flight is
        not yet in the n-gram lookup."""
        seqs = [s for s in self.scheduler.running if s.num_to_compute == 1 and not s.reached_length_limit
                and not _position_dependent(s)
                and s.output.grammar is None]  # a constrained row's mask needs the token before it: none to guess
        proposer, controller = self._speculation()
        if not self.adaptive:
            return {s: controller.k for s in seqs}
        return controller.choose(seqs, proposer.available)

    def _speculation(self) -> tuple[Proposer, SpecController]:
        """The proposer and its controller: speculative decoding has both (the engine factory gives both or
        neither)."""
        assert self.proposer is not None and self.controller is not None, "speculation needs a proposer and controller"
        return self.proposer, self.controller

    def _speculative_step(self, lengths: dict[Sequence, int]) -> None:
        """A step planned with every token on the host, and waited for: its proposals continue the latest tokens,
        and the plan after it must know how many were accepted. So the step before is read back first, and the
        host's work no longer overlaps the device's for this step (what that costs: BENCHMARKS.md)."""
        proposer, controller = self._speculation()
        self._read_back()
        start = time.perf_counter()
        batch = self.scheduler.schedule(lengths, proposer.propose)
        self._import(batch)
        if not batch:
            return
        self._update(self._dispatch(batch))
        speculating = [k for k in batch.num_draft.values() if k]
        controller.num_speculating = len(speculating)
        if self.adaptive:
            controller.observe_step(batch.num_tokens, time.perf_counter() - start, True, len(batch.rows),
                                    len(speculating), max(speculating, default=0))

    def _import(self, batch: ScheduledBatch) -> None:
        """Writes the K/V of the prefilled sequences admitted to `batch` into their pages, before its step. An import
        that fails ends its own request only: its rows leave the batch before the step is dispatched. The host tier's
        stores and loads go first (a load is an import from host memory)."""
        if self.host is not None:
            self.host.run(batch)
        self._failed_imports.update(write_imports(self.runner, batch))
        if self._failed_imports:
            for request_id in self._failed_imports:
                self.abort(request_id)
            batch.drop(set(self._failed_imports))

    def _dispatch(self, batch: ScheduledBatch) -> InFlight:
        split = self.runner.splits_sampling
        if batch.masks_later and not split:  # the engine reads such a row's last step back first
            raise RuntimeError("a row under a grammar was planned before its previous token was known")
        handle = self.runner.dispatch(batch.rows, masks_later=True) if batch.masks_later \
            else self.runner.dispatch(batch.rows)
        self.counters.prompt_tokens += sum(c.length for c in batch.prefill)
        # A constrained row's mask needs this step's token: a runner that cannot split plans after reading it back.
        return InFlight(batch, handle, time.perf_counter(), reads_back_first=batch.constrained and not split)

    def stats(self) -> EngineStats:
        return replica_stats(self.scheduler, self.counters, self.transfers, self.controller, self.healthy,
                             None if self.host is None else self.host.tier)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix no running sequence holds, on the device and in the host tier."""
        self.scheduler.cache.reset()
        if self.host is not None:
            self.host.tier.clear()

    def assert_idle_and_clean(self) -> None:
        """For tests: nothing queued, nothing in flight, no page held by anyone but the prefix cache."""
        assert not self.has_unfinished()
        cache = self.scheduler.cache
        assert cache.num_available == cache.allocator.num_usable, "a page is still held"
        assert sorted(self.scheduler._free_slots) == list(range(self.scheduler.max_num_seqs))
        assert not self.transfers.landing, "a KV copy is still counted as landing"
        assert all(s.status is not Status.RUNNING for s in self.scheduler.waiting)
