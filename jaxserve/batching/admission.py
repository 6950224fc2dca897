"""Admission: a request joins the waiting queue, and a waiting sequence becomes a running one once a slot, its
adapter's slot and the pages for its whole prompt (less what the prefix cache holds) are free.

LoRA adapters (`lora_slots`): a running sequence with an adapter holds one of the runner's adapter slots, so a step
never has more distinct adapters than slots. (The scheduler keeps a waiting adapter sequence that finds no slot,
and every adapter sequence after it, waiting: see `Scheduler._admit_waiting`.)

Disaggregated serving (`jaxserve.batching.pools.disaggregated`): a decode scheduler (role "decode", or "both") takes
a sequence prefilled elsewhere with its KV pages (`add_prefilled`): it waits like any other, and once its KV has
landed and a slot and pages for all its tokens are free it is admitted (one a step) with its prompt counted as
computed and the pages to import listed in the step (`ScheduledBatch.imports`), which the engine writes into the
cache before the step runs; then it decodes as any other, and a preemption later recomputes it from its tokens as usual.
"""
from __future__ import annotations

import time
from typing import Callable

from jaxserve.batching.residency import Residency
from jaxserve.batching.sequence import Sequence, Status
from jaxserve.batching.step_plan import Load
from jaxserve.cache import PrefixCache, page_keys, pages_needed
from jaxserve.cache.transfer import KVPages
from jaxserve.lora.slot_cache import LoRASlots


class Admission(Residency):
    def __init__(self, cache: PrefixCache, max_num_seqs: int, policy: str, lora_slots: LoRASlots | None):
        super().__init__(cache, max_num_seqs, policy, lora_slots)
        # Waiting prefilled sequences: (tokens cached, KV, when added, whether the KV has landed); how many were
        # admitted, after how long.
        self._imports: dict[Sequence, tuple[int, KVPages, float, Callable[[], bool]]] = {}
        self.num_prefilled_admitted, self.prefilled_wait_seconds = 0, 0.0
        self._admitted_imports: list[tuple[Sequence, list[int], KVPages]] = []  # while planning a step
        self._admitted_loads: list[Load] = []  # host-tier pages to load, while planning a step

    def check_fits(self, seq: Sequence) -> None:
        need = pages_needed(seq.max_total_tokens, self.page_size)
        if need > self.cache.allocator.num_usable:
            raise ValueError(f"a sequence of up to {seq.max_total_tokens} tokens needs {need} KV pages "
                             f"but the cache has {self.cache.allocator.num_usable}; lower max_tokens or raise the "
                             "KV budget")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        if seq.lora is not None and self.lora_slots is None:
            raise ValueError(f"request {seq.request_id} names LoRA adapter {seq.lora.request.lora_name!r}, but this "
                             "engine was started without enable_lora")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, num_cached: int, kv: KVPages, first_token: int | None = None,
                      landed: Callable[[], bool] = lambda: True) -> None:
        """A sequence prefilled elsewhere: its first num_cached tokens' K/V are kv's pages, its first token taken
        (first_token: taken here, for a sequence built here; the output processor has said it already). It waits,
        holding only kv, until kv has landed (`landed()`: a step that imports it then never waits for the devices
        it comes from) and a slot and pages for all its tokens are free."""
        if first_token is not None and not seq.output_token_ids:
            if seq.token_ids_array is not None:
                seq.token_ids_array[len(seq.prompt_token_ids)] = first_token
            seq.output_token_ids.append(first_token)
            seq.first_token_time = time.monotonic()
        if not seq.output_token_ids or seq.pending or num_cached != seq.num_tokens - 1:
            raise ValueError(f"request {seq.request_id}: a prefilled sequence has its first token and the K/V of "
                             f"every token before it ({seq.num_tokens - 1}), got {num_cached}")
        if seq.lora is not None:
            raise ValueError(f"request {seq.request_id}: LoRA adapters are not supported with disaggregated prefill")
        self.add(seq)
        self._imports[seq] = (num_cached, kv, time.monotonic(), landed)

    def can_take_prefilled(self, seq: Sequence) -> bool:
        """A prefilled sequence given now would be admitted at once (once its KV has landed): a slot and pages for
        its tokens are free after every waiting sequence (prefilled ones landing, preempted ones) has had its own."""
        promised = sum(pages_needed(q.num_tokens, self.page_size) for q in self.waiting)
        return (len(self.running) + len(self.waiting) < self.max_num_seqs
                and promised + pages_needed(seq.num_tokens, self.page_size) <= self.cache.num_available)

    def awaits_kv(self) -> bool:
        """A prefilled sequence waits for its KV to land."""
        return any(not landed() for _, _, _, landed in self._imports.values())

    def _importable(self, seq: Sequence) -> bool:
        """False only for a prefilled sequence whose KV is still on its way, or that another import this step
        comes before: one import a step, so the engine thread's work before a step (its scatter into the cache) is
        one sequence's pages at most, never a burst's (issue 53: imports stalled the decode steps)."""
        return seq not in self._imports or (not self._admitted_imports and self._imports[seq][3]())

    def _admit(self, seq: Sequence, cap: int) -> bool:
        """Gives a waiting sequence a slot, its adapter's slot (the caller saw one can be had), its cached prefix,
        and pages for all its tokens; False if it must wait."""
        # The adapter slot first: loading it is the step that can fail, and then nothing else is held yet.
        lora_slot = self._adapter_slots().take(seq.lora) if seq.lora is not None else -1
        admitted = False
        try:
            admitted = self._admit_pages(seq, cap)
        finally:
            if lora_slot >= 0 and not admitted:  # it keeps the adapter for the next try; nobody counts as using it
                self._adapter_slots().release(lora_slot)
        if admitted:
            seq.lora_slot = lora_slot
        return admitted

    def _admit_pages(self, seq: Sequence, cap: int) -> bool:
        """_admit once its adapter has a slot: a slot in the batch, the cached prefix and pages."""
        if seq in self._imports:
            return self._admit_prefilled(seq, cap)
        while True:
            if len(self.running) < cap:
                tokens = seq.token_ids
                keys = page_keys(tokens[:len(tokens) - 1], self.page_size, seq.page_keys, seq.prefix_salt)
                # At least the last token is computed, whatever is cached: its logits give the next token. A
                # sequence scoring its prompt computes all of it (its pages are still published).
                most = 0 if seq.scores_prompt else (len(tokens) - 1) // self.page_size
                hit = self.cache.match(tokens, keys, most)
                host = self._host_hit(seq, keys, len(hit), most)
                need = pages_needed(len(tokens), self.page_size) - len(hit)
                if need <= self.cache.num_available:
                    break
                self.cache.release(hit)
            if not self._preempt_for(seq, cap):
                return False
        seq.pages = hit + self.cache.allocate(need)
        if host:  # loaded into the first fresh pages before the step; published with the step's own pages
            self._admitted_loads.append(Load(seq, seq.pages[len(hit):len(hit) + len(host)], host,
                                             seq.num_preemptions))
        seq.num_cached = seq.num_written = (len(hit) + len(host)) * self.page_size
        seq.num_published = len(hit)
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = seq.num_cached
        if not seq.scores_prompt:
            self.cache.count_lookup(len(tokens), (len(hit) + len(host)) * self.page_size, len(host) * self.page_size)
        self._start(seq)
        return True

    def _host_hit(self, seq: Sequence, keys: list[bytes], start: int, most: int) -> list[bytes]:
        """The keys of the pages after the device's hit that the host tier holds, if loading them beats computing
        them (a preempted sequence's pages come back this way: swapped in rather than recomputed)."""
        host = self.cache.match_host(seq.token_ids, keys, start, most)
        if host and self.cache.host is not None and not self.cache.host.worth_loading(len(host), self.page_size):
            return []
        return host

    def _admit_prefilled(self, seq: Sequence, cap: int) -> bool:
        """A prefilled sequence: pages for all its tokens, the first ones to be written from its KV before the
        step; only its first token (the next step's input) is left to compute."""
        need = pages_needed(seq.num_tokens, self.page_size)
        while len(self.running) >= cap or need > self.cache.num_available:
            if not self._preempt_for(seq, cap):
                return False
        num_cached, kv, added, _ = self._imports.pop(seq)
        self.num_prefilled_admitted += 1
        self.prefilled_wait_seconds += time.monotonic() - added
        seq.pages = self.cache.allocate(need)
        # Written once the import has run, which comes before any step that reads or publishes them.
        seq.num_cached = seq.num_written = num_cached
        seq.num_published = 0
        seq.num_cached_prompt_tokens = 0  # computed elsewhere: none found in this engine's prefix cache
        self._admitted_imports.append((seq, seq.pages[:pages_needed(num_cached, self.page_size)], kv))
        self._start(seq)
        return True
