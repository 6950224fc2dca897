"""The engine's side of disaggregated prefill (`jaxserve.batching.pools.disaggregated`): KV pages leaving a prefill
engine and arriving at a decode engine.

A prefill engine's scheduler hands each sequence off once its first token has landed, its pages held until
`EngineCore.take_handed_off` (called when a decode engine can admit it: `can_take_prefilled`) dispatches their
export (a gather on the device, `export_handed_off`) and only then gives them back, so a later step that reuses them
runs after the gather. A decode engine takes it with those pages (`EngineCore.add_prefilled`), copies them to its
own devices at once (`copy_in`), and writes them into its cache when the scheduler admits it (once the copy has
landed, so a decode step never waits for the prefill devices, which may still be running the step after the
export), before the step that first reads them is dispatched (`write_imports`). A decode server copies fetched pages
to its devices before it adds the sequence, on its import thread (`staged`), so its engine thread only scatters
them; and its scheduler admits one import a step (`Admission`), so a burst of them never stalls one step.
"""
from __future__ import annotations

import dataclasses
import time

import jax

from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.sequence import Sequence
from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import KVPages, is_ready, kv_bytes, num_pages
from jaxserve.runner.protocol import Runner


@dataclasses.dataclass
class HandOff:
    """A prefilled sequence leaving its prefill engine: the K/V of its first num_cached tokens (its prompt), as
    exported pages (perhaps padded past them; still in flight), and when the export was dispatched."""
    seq: Sequence
    kv: KVPages
    num_cached: int
    exported_at: float  # time.perf_counter()


@dataclasses.dataclass
class Transfer:
    """KV pages on their way to this engine's devices."""
    started: float  # time.perf_counter()
    kv: KVPages
    num_bytes: int


class KVTransfers:
    """The copies still landing here, by the prefilled sequence they are for, and those landed: how many, their
    bytes, and their seconds from export to landing (polled once per step, so each is late by up to a step)."""

    def __init__(self):
        self.landing: dict[Sequence, Transfer] = {}
        self.count, self.num_bytes, self.seconds = 0, 0, 0.0

    def add(self, seq: Sequence, kv: KVPages, started: float) -> None:
        self.landing[seq] = Transfer(started, kv, kv_bytes(kv))

    def drop(self, seq: Sequence) -> None:
        """Its sequence is out: a copy still landing for it never counts as a transfer."""
        self.landing.pop(seq, None)

    def count_landed(self) -> None:
        """Counts the transfers that have landed (without waiting for any)."""
        now = time.perf_counter()
        for seq, t in [(seq, t) for seq, t in self.landing.items() if is_ready(t.kv)]:
            del self.landing[seq]
            self.count += 1
            self.num_bytes += t.num_bytes
            self.seconds += now - t.started

    def wait(self) -> None:
        """Blocks until every copy still landing has landed."""
        jax.block_until_ready([t.kv for t in self.landing.values()])


def export_handed_off(scheduler: Scheduler, runner: Runner, seqs: list[Sequence] | None) -> list[HandOff]:
    """The sequences the prefill scheduler has handed off (seqs: those of them; None: all), their pages' export
    dispatched; their pages are then free here."""
    handed = []
    for seq in [s for s in scheduler.handed_off if seqs is None or s in seqs]:
        kv = runner.export_pages(seq.pages[:pages_needed(seq.num_cached, scheduler.page_size)])
        handed.append(HandOff(seq, kv, seq.num_cached, time.perf_counter()))
        scheduler.release_handed_off(seq)
    return handed


def copy_in(runner: Runner, seq: Sequence, kv: KVPages, num_cached: int, page_size: int) -> KVPages:
    """kv, the K/V of seq's first num_cached tokens, on its way to this runner's devices. Raises ValueError if kv
    is not pages of this cache's layout and dtype holding num_cached tokens."""
    need = pages_needed(num_cached, page_size)
    if num_pages(kv) < need:  # a cut copy would import the cache's padding as its K/V
        raise ValueError(f"request {seq.request_id}: {num_cached} cached tokens need {need} KV pages, "
                         f"got {num_pages(kv)}")
    try:
        return runner.put_pages(kv)
    except ValueError as e:
        raise ValueError(f"request {seq.request_id}: {e}") from e


def staged(runner: Runner, seq: Sequence, kv: KVPages, num_cached: int, page_size: int) -> KVPages:
    """copy_in, waited for: kv on this runner's devices, padded to its bucket, landed. What a decode server's import
    thread (`jaxserve.kv_transfer.worker`) does with fetched pages before the engine thread sees them, so that
    add_prefilled's copy_in finds them in place (no padding, no copy) and the engine thread's only work for an
    import is its scatter into the cache (`write_imports`). It reads only the cache's layout, never writes it: the
    engine thread stays the cache's one writer."""
    kv = copy_in(runner, seq, kv, num_cached, page_size)
    return jax.block_until_ready(kv)


def write_imports(runner: Runner, batch: ScheduledBatch) -> dict[str, BaseException]:
    """Writes the K/V of the prefilled sequences admitted to `batch` into their pages, before its step. Returns
    request id -> why its import failed: a failure ends its own request only (the caller's to take out)."""
    failed: dict[str, BaseException] = {}
    for seq, pages, kv in batch.imports:
        try:
            runner.import_pages(pages, kv)
        except Exception as e:  # noqa: BLE001 - these pages' failure (a bad copy), not the step's
            failed[seq.request_id] = e
    return failed
