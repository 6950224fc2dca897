"""The engine's side of the host KV tier (`jaxserve.cache.host_tier`): it carries out what a plan says to move,
through the runner, before the plan's step is dispatched, and it is the tier's one writer.

Per step, in this order: the host pages the plan loads are read out of the tier (before a store may push them out
of its budget); the pages the plan evicted are exported and handed to the tier (dispatched, not waited for: JAX runs
the export before any later step, load or import that writes those pages again, see `ModelRunner.export_pages`);
then the loads are listed as imports of the plan (`ScheduledBatch.imports`), which the engine writes into their
pages before the step like any import, a failed one ending its own request only. A preempted sequence's pages stay in
the prefix cache and go to the tier when evicted, so it comes back through a load rather than a recompute.

Exports and loads move at most the runner's largest page-count bucket at a time, so they run only the transfer
programs compiled at warm-up.
"""
from __future__ import annotations

import time

import jax

from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.cache.host_tier import HostTier
from jaxserve.cache.kv_cache import SCRATCH_PAGE
from jaxserve.cache.transfer import kv_bytes
from jaxserve.runner.protocol import Runner


class HostSwap:
    def __init__(self, tier: HostTier, runner: Runner):
        self.tier = tier
        self.runner = runner

    def run(self, batch: ScheduledBatch) -> None:
        """Stores the plan's evicted pages and lists its loads as imports (see the module's docstring)."""
        loads = [(load.seq, load.pages, self.tier.load(load.keys)) for load in batch.loads]
        most = self.runner.page_buckets[-1]
        for i in range(0, len(batch.stores), most):
            part = batch.stores[i:i + most]
            self.tier.store([content for _, content in part], self.runner.export_pages([p for p, _ in part]))
        for seq, pages, kv in loads:
            for j in range(0, len(pages), most):
                moved = self.runner.put_pages(jax.tree.map(lambda x, j=j: x[j:j + most], kv))
                self.tier.loading(moved)
                batch.imports.append((seq, pages[j:j + most], moved))

    def poll(self, wait: bool = False) -> None:
        """Counts what has landed, without waiting (once per step); wait: once everything has (the engine goes
        idle: no step would poll them until the next request, and their seconds would count the idle gap)."""
        self.tier.settle(wait)

    def calibrate(self) -> None:
        """Times one round trip of the largest page bucket through host memory (after warm-up: nothing compiles),
        which with the prefill rate (from the warm-up's step times) says when loading pages beats recomputing
        them."""
        ids = [SCRATCH_PAGE] * self.runner.page_buckets[-1]  # no content touched
        jax.block_until_ready(self.runner.export_pages(ids))
        start = time.perf_counter()
        kv = jax.tree.map(jax.device_get, self.runner.export_pages(ids))
        jax.block_until_ready(self.runner.put_pages(kv))
        seconds = time.perf_counter() - start
        self.tier.bytes_per_s = 2 * kv_bytes(kv) / seconds if seconds > 0 else None
        self.tier.tokens_per_s = prefill_rate(self.runner.step_times)


def prefill_rate(step_times: dict[tuple[int, int], float]) -> float | None:
    """Prompt tokens a second at the largest step the warm-up timed (None: none timed)."""
    plain = {tokens: s for (tokens, scored), s in step_times.items() if scored == 1 and s > 0}
    if not plain:
        return None
    tokens = max(plain)
    return tokens / plain[tokens]
