"""Data parallelism: several engine replicas, each a whole engine (scheduler, KV cache, runner) on its own device
group, behind one request interface (EngineCore's).

One scheduler per replica, not one global one: replicas share no pages, prefix cache or step, so a global
scheduler would only tie the groups' steps together; what has to be global is where a request goes. It goes to the
replica with the fewest sequences queued or running; among equals, to the one whose prefix cache already holds
the most of its prompt (under its LoRA adapter, if any), then to one holding its adapter in a slot, then to the one
sent the fewest requests (so replicas idle in turn share the work); a
request's n sequences stay together (they share its prompt's pages). Stepping the replicas
one after the other keeps them all busy: each step dispatches its replica's next step before it reads back the one
before, so while one replica's host waits for its device the others' devices are computing. LoRA adapters: the
host's are shared, and each replica loads them into its own runner's slots as its sequences need them.

A replica is a unit of failure too: a failed step ends only that replica's requests (the others' results of the
round still reach theirs), and a replica whose steps keep failing leaves the routing for good while the others
serve on (its state shows in the stats: /health and /metrics).
"""
from __future__ import annotations

import dataclasses

from jaxserve.batching.engine_core import EngineCore, EngineDeadError, StepError
from jaxserve.batching.engine_stats import EngineStats
from jaxserve.batching.kv_handoff import HandOff
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.sequence import Sequence
from jaxserve.cache import page_keys
from jaxserve.cache.transfer import KVPages


class DataParallel:
    def __init__(self, replicas: list[EngineCore]):
        self.replicas = replicas
        self._placed: dict[str, EngineCore] = {}  # request id -> its replica, while it has sequences
        self.routed = [0] * len(replicas)  # requests sent to each replica

    def route(self, seq: Sequence, prefer=None) -> EngineCore:
        """The healthy replica a new request's sequence goes to (the one its siblings went to, if any); prefer(core)
        -> bool: only those it prefers, if any is."""
        if seq.request_id in self._placed:
            return self._placed[seq.request_id]
        healthy = [i for i, core in enumerate(self.replicas) if core.healthy]
        if not healthy:
            raise EngineDeadError("every data-parallel replica has stopped after failed steps")
        if prefer is not None:
            healthy = [i for i in healthy if prefer(self.replicas[i])] or healthy
        # Replicas share one page size: the prompt is hashed once, whatever their number.
        keys = page_keys(seq.prompt_token_ids, self.replicas[0].scheduler.cache.page_size, [], seq.prefix_salt)

        def load(i: int) -> tuple[int, int, bool, int]:
            s = self.replicas[i].scheduler
            return len(s.waiting) + len(s.running), -s.cache.num_cached_pages(seq.prompt_token_ids, keys), \
                not _holds_adapter(s, seq), self.routed[i]
        best = min(healthy, key=load)
        self.routed[best] += 1
        return self.replicas[best]

    def add(self, seq: Sequence) -> None:
        core = self.route(seq)
        core.add(seq)
        self._placed[seq.request_id] = core

    def add_prefilled(self, seq: Sequence, kv: KVPages, num_cached: int, **kw) -> None:
        """A sequence prefilled elsewhere (EngineCore.add_prefilled's arguments), to the replica routing picks (its
        request's, if it has one here), among those that would admit it now if any would."""
        core = self.route(seq, lambda core: core.can_take_prefilled(seq))
        core.add_prefilled(seq, kv, num_cached, **kw)
        self._placed[seq.request_id] = core

    def can_take_prefilled(self, seq: Sequence) -> bool:
        """The replica add_prefilled would pick for seq admits it as soon as its KV lands."""
        if seq.request_id in self._placed:
            return self._placed[seq.request_id].can_take_prefilled(seq)
        return any(core.can_take_prefilled(seq) for core in self.replicas)

    def take_handed_off(self, seqs: list[Sequence] | None = None) -> list[HandOff]:
        """Every replica's hand-offs, or those of seqs (see EngineCore.take_handed_off); a request none of whose
        sequences is left here is forgotten."""
        handed = [h for core in self.replicas for h in core.take_handed_off(seqs)]
        for h in handed:
            if not self._holds(h.seq.request_id):
                self._placed.pop(h.seq.request_id, None)
        return handed

    def wait_in_flight(self) -> None:
        """Each replica as EngineCore.wait_in_flight, but those that plan just in time all wait once, until the
        earliest of their planning times: step() plans the replicas one after another, so waiting for each in
        turn would plan the later ones late."""
        timed = [core for core in self.replicas if core.plans_just_in_time]
        for core in self.replicas:
            if core not in timed:
                core.wait_in_flight()
        plans = [(at, i) for i, core in enumerate(timed) if (at := core.plan_at()) is not None]
        if plans:  # none timed yet: plan now, as with async scheduling before these waits
            at, i = min(plans)
            timed[i].wait_until(at)

    def step(self) -> list[SequenceDelta]:
        """Steps every replica with work. If any failed: StepError with every replica's results and the failed
        replicas' ended requests (the rest of the round ran)."""
        changed, failed, cause = [], {}, None
        for core in self.replicas:
            if core.has_unfinished():
                try:
                    changed += core.step()
                except StepError as e:
                    changed += e.changed
                    failed.update(e.failed)
                    cause = cause or e.cause
        for d in changed:
            if d.finished and not self._holds(d.seq.request_id):
                self._placed.pop(d.seq.request_id, None)
        for request_id in failed:
            self._placed.pop(request_id, None)
        if cause is not None:
            raise StepError(cause, changed, failed)
        return changed

    def _holds(self, request_id: str) -> bool:
        core = self._placed.get(request_id)
        s = core.scheduler if core else None
        return s is not None and any(q.request_id == request_id for q in s.waiting + s.running + s.handed_off)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.replicas)

    def abort(self, request_id: str) -> list[Sequence]:
        core = self._placed.pop(request_id, None)
        return core.abort(request_id) if core else []

    def abort_all(self) -> None:
        for core in self.replicas:
            core.abort_all()
        self._placed.clear()

    def stats(self) -> EngineStats:
        return merge_stats([core.stats() for core in self.replicas])

    def assert_idle_and_clean(self) -> None:
        for core in self.replicas:
            core.assert_idle_and_clean()
        assert not self._placed


def _holds_adapter(scheduler, seq: Sequence) -> bool:
    """The replica has the sequence's LoRA adapter in a slot already (loading it elsewhere costs a copy)."""
    return seq.lora is not None and scheduler.lora_slots is not None and \
        scheduler.lora_slots.slot_of(seq.lora) is not None


# EngineStats' numbers that do not add up over replicas: the same in each (page size), or the latest (time).
_NOT_SUMMED = ("page_size", "snapshot_time")


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts add up, rates are recomputed from the sums, the LoRA adapters
    running or waiting are those of any replica. max_lora adds up too: each replica runs its own adapters, so the
    server runs up to that many at once (what the gateway compares the running adapters, all replicas', with)."""
    total = {f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(EngineStats)
             if f.type in ("int", "float") and f.name not in _NOT_SUMMED}
    per_pos = [sum(xs) for xs in zip(*(p.spec_decode_num_accepted_tokens_per_pos for p in parts))]
    total.update(kv_cache_usage=total["pages_used"] / total["pages_total"],
                 prefix_cache_hit_rate=total["prefix_cache_hits"] / max(1, total["prefix_cache_queries"]),
                 spec_decode_acceptance_rate=total["spec_decode_num_accepted_tokens"]
                 / max(1, total["spec_decode_num_draft_tokens"]),
                 spec_decode_num_accepted_tokens_per_pos=tuple(per_pos),
                 running_lora_adapters=tuple(sorted({a for p in parts for a in p.running_lora_adapters})),
                 waiting_lora_adapters=tuple(sorted({a for p in parts for a in p.waiting_lora_adapters})),
                 snapshot_time=max(p.snapshot_time for p in parts))
    return dataclasses.replace(parts[0], **total)
