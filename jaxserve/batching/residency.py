"""What a sequence holds while it runs - a batch slot, KV pages, an adapter's slot - and the moves that give or take
them: start, grow (preempting when pages run short), preempt, hand off, take out; with the pages that completed
steps have filled published to the prefix cache, and those holding only rejected proposals given back.

Preemption: a running sequence that needs a new page when none is left preempts the worst-priority, newest running
sequence (perhaps itself): its pages go back (full ones stay in the prefix cache) and it is later recomputed from its
tokens. Under the priority policy a waiting sequence may also displace a strictly worse running one.

`Residency` is the base of `jaxserve.batching.scheduler.Scheduler`: the state every part of the scheduler shares
(the waiting, running and handed-off sequences, the free slots) and the moves on it. Like the rest of the
scheduler, it is a writer of a Sequence's fields (`tests/batching/test_state_owners.py`).
"""
from __future__ import annotations

import time

from jaxserve.batching.sequence import Sequence, Status
from jaxserve.batching.step_plan import ScheduledBatch
from jaxserve.cache import PrefixCache, page_keys, pages_needed
from jaxserve.lora.slot_cache import LoRASlots


class Residency:
    def __init__(self, cache: PrefixCache, max_num_seqs: int, policy: str, lora_slots: LoRASlots | None):
        self.cache = cache
        self.page_size = cache.page_size
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.lora_slots = lora_slots
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.handed_off: list[Sequence] = []  # prefilled, pages held until exported
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def priority(self, seq: Sequence):
        return seq.effective_priority if self.policy == "priority" else (0, seq.arrival)

    def _start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        seq.slot = self._free_slots.pop()
        self.waiting.remove(seq)
        self.running.append(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for num_tokens, preempting worse sequences (or `seq`) if none are free."""
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        while need > self.cache.num_available:
            victim = max(self.running, key=self.priority)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.cache.allocate(need)
        return True

    def _preempt_for(self, seq: Sequence, cap: int) -> bool:
        """Under the priority policy, a waiting sequence displaces a strictly worse running one, if one is enough."""
        if self.policy != "priority" or not self.running or len(self.running) > cap:
            return False
        victim = max(self.running, key=self.priority)
        if self.priority(victim)[0] <= self.priority(seq)[0]:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._take_out(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def _take_out(self, seq: Sequence) -> None:
        # No publishing here: what completed steps filled is published already, and what is still in flight may
        # never be written.
        self.cache.release(seq.pages)
        seq.pages, seq.num_cached, seq.num_written, seq.num_published, seq.num_draft_cached = [], 0, 0, 0, 0
        self._release_slots(seq)

    def _hand_off(self, seq: Sequence) -> None:
        """Its prompt computed and first token taken: out of the batch, its pages held for the export."""
        self._release_slots(seq)
        self.running.remove(seq)
        seq.status = Status.HANDED_OFF
        self.handed_off.append(seq)

    def _release_slots(self, seq: Sequence) -> None:
        """A running sequence leaves the batch: its slot, and its adapter's slot if it has one, go back."""
        assert seq.slot is not None, f"request {seq.request_id} leaves the batch but holds no slot"
        self._free_slots.append(seq.slot)
        seq.slot = None
        if seq.lora_slot >= 0:
            self._adapter_slots().release(seq.lora_slot)
            seq.lora_slot = -1

    def _adapter_slots(self) -> LoRASlots:
        """The runner's adapter slots, there wherever a sequence has an adapter (`Admission.add` refuses one
        on an engine without them)."""
        assert self.lora_slots is not None, "a LoRA adapter on an engine without enable_lora"
        return self.lora_slots

    def release_handed_off(self, seq: Sequence) -> None:
        """A handed-off sequence's pages go back (their export dispatched first: JAX runs a later step that
        reuses them after it); full ones stay in the prefix cache. Its status is the taker's to set."""
        self.handed_off.remove(seq)
        self.cache.release(seq.pages)
        seq.pages, seq.num_cached, seq.num_written, seq.num_published, seq.num_draft_cached = [], 0, 0, 0, 0

    def _written(self, plan: ScheduledBatch) -> None:
        """After `plan`'s step has completed: its full pages are in the cache, so the prefix cache may serve them.

        Never earlier: a step that fails on the device leaves pages that were never written, which must not be
        served as cached prefixes. A sequence preempted since the step was planned has given those pages back.
        """
        for w in plan.writes:
            if w.seq.status is Status.RUNNING and w.seq.num_preemptions == w.num_preemptions:
                w.seq.num_written = max(w.seq.num_written, w.end)
                self.publish(w.seq)

    def _roll_back(self, seq: Sequence, num_rejected: int) -> None:
        """After a verification step: the rejected proposals' K/V stay in the cache unread, past the sequence's
        length, to be overwritten; pages holding nothing but them go back."""
        seq.num_cached -= num_rejected
        seq.num_draft_cached = min(seq.num_draft_cached, seq.num_cached)
        keep = pages_needed(seq.num_tokens, self.page_size)  # the next step writes the last token's K/V
        if len(seq.pages) > keep:
            self.cache.release(seq.pages[keep:])
            del seq.pages[keep:]

    def publish(self, seq: Sequence) -> None:
        """Tells the prefix cache about the sequence's pages that completed steps have filled."""
        full = seq.num_written // self.page_size
        if full > seq.num_published:
            keys = page_keys(seq.token_ids[:full * self.page_size], self.page_size, seq.page_keys, seq.prefix_salt)
            self.cache.publish(seq.pages, seq.token_ids, keys[:full], seq.num_published)
            seq.num_published = full
