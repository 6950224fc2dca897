"""Disaggregated prefill: a pool of prefill replicas and a pool of decode replicas, each an engine on its own device
group, behind one request interface (EngineCore's, as DataParallel's).

A request goes to the least-loaded prefill replica (`DataParallel` routing: prefix-cache hits break ties), whose
scheduler (role "prefill") runs its prompt in chunks and samples its first token; it is never decoded there. Each
step, the prefill replicas' hand-offs move, oldest first, to the least-loaded decode replica that can admit them
now (a free slot and pages for its tokens, after what it has promised to the sequences waiting there): the pages a
sequence's prompt fills are exported (a gather on the prefill devices), copied to the decode replica's devices
(`jax.device_put`, resharded to its cache's split over KV heads, so the pools may differ in tensor parallelism), and
written into its cache once the copy has landed. Until a decode replica can admit it, a handed-off sequence stays on
its prefill replica holding its pages there: a busy decode pool fills the prefill cache and so stalls the prefill
pool, and no copy ever waits on the decode devices outside their cache's budget. Each pool scales on its own:
prompt chunks never stretch a decode step, and decode rows never delay a prompt.

A step that fails ends only the requests of the replica it ran on (a request with sequences in both pools ends
whole); abort finds a request wherever it is. Moving pages never compiles while serving: page counts are bucketed,
and every pair of prefill and decode runner moves each bucket once at warm-up (`warm_up_transfers`).
"""
from __future__ import annotations

import dataclasses

from jaxserve.batching.engine_core import EngineCore, StepError
from jaxserve.batching.engine_stats import EngineStats
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.pools.data_parallel import DataParallel, merge_stats
from jaxserve.batching.sequence import Sequence
from jaxserve.cache import SCRATCH_PAGE


class Disaggregated:
    def __init__(self, prefill: list[EngineCore], decode: list[EngineCore]):
        if not prefill or not decode:
            raise ValueError("disaggregated prefill needs a prefill replica and a decode replica at least")
        if any(core.scheduler.role != "prefill" for core in prefill):
            raise ValueError("a prefill replica's scheduler must have role 'prefill'")
        if any(core.scheduler.role == "prefill" for core in decode):
            raise ValueError("a decode replica's scheduler must not have role 'prefill'")
        self.prefill, self.decode = DataParallel(prefill), DataParallel(decode)
        self.replicas = prefill + decode

    def add(self, seq: Sequence) -> None:
        # Checked where it will decode before it is prefilled: a decode pool too small must refuse it now.
        self.decode.replicas[0].scheduler.check_fits(seq)
        self.prefill.add(seq)

    def wait_in_flight(self) -> None:
        self.prefill.wait_in_flight()
        self.decode.wait_in_flight()

    def step(self) -> list[SequenceDelta]:
        """Steps the prefill replicas, moves their hand-offs to the decode pool, steps the decode replicas. If any
        failed: StepError with every result of the round and the ended requests."""
        changed: list[SequenceDelta] = []
        failed: dict[str, BaseException] = {}
        cause: BaseException | None = None
        try:
            changed += self.prefill.step()
        except StepError as e:
            changed, failed, cause = changed + e.changed, {**failed, **e.failed}, e.cause
        for seq in self._handed_off():
            if seq.request_id in failed:
                continue  # a sibling's replica failed: the request has ended (and the abort below frees its pages)
            if not self.decode.can_take_prefilled(seq) and any(core.healthy for core in self.decode.replicas):
                break  # it waits on its prefill replica, holding its pages there, and those after it too
            (hand_off,) = self.prefill.take_handed_off([seq])
            try:
                self.decode.add_prefilled(seq, hand_off.kv, hand_off.num_cached, started=hand_off.exported_at)
            except Exception as e:  # noqa: BLE001 - no decode replica takes it: its request ends, others go on
                failed[seq.request_id] = e
                cause = cause or e
        try:
            changed += self.decode.step()
        except StepError as e:
            changed, failed, cause = changed + e.changed, {**failed, **e.failed}, cause or e.cause
        for request_id in failed:  # its sequences in the other pool end too: none may hang
            self.abort(request_id)
        if cause is not None:
            raise StepError(cause, changed, failed)
        return changed

    def _handed_off(self) -> list[Sequence]:
        """The prefill pool's sequences waiting to move to the decode pool, oldest first."""
        return sorted((s for core in self.prefill.replicas for s in core.scheduler.handed_off), key=lambda s: s.arrival)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    def abort(self, request_id: str) -> list[Sequence]:
        return self.prefill.abort(request_id) + self.decode.abort(request_id)

    def abort_all(self) -> None:
        self.prefill.abort_all()
        self.decode.abort_all()

    def stats(self) -> EngineStats:
        pools = tuple((name, sum(len(c.scheduler.running) for c in pool.replicas),
                       sum(len(c.scheduler.waiting) for c in pool.replicas))
                      for name, pool in (("prefill", self.prefill), ("decode", self.decode)))
        return dataclasses.replace(merge_stats([core.stats() for core in self.replicas]), pools=pools)

    def assert_idle_and_clean(self) -> None:
        self.prefill.assert_idle_and_clean()
        self.decode.assert_idle_and_clean()

    def warm_up_transfers(self) -> None:
        """Moves every page-count bucket from each prefill runner to each decode runner (the scratch page only): a
        copy between meshes of different splits compiles a program of its own the first time."""
        for p in self.prefill.replicas:
            for d in self.decode.replicas:
                for size in p.runner.page_buckets:
                    ids = [SCRATCH_PAGE] * size
                    d.runner.import_pages(ids, p.runner.export_pages(ids))
