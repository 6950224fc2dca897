"""The host loop's decisions: which sequences run, and whether this step prefills or decodes.

Policy (plain FCFS): admit waiting sequences while a slot (`max_num_seqs`) and the pages for their whole length are
free; then prefill one chunk of the oldest sequence still in prefill, or else decode every running sequence.
Reserving pages for the whole length means a running sequence never runs out of pages.
"""
from __future__ import annotations

from collections import deque

from jaxserve.batching.batch_builder import Row
from jaxserve.batching.model_runner import ModelRunner
from jaxserve.batching.sequence import Sequence, Status
from jaxserve.cache import PageAllocator, pages_needed


class Scheduler:
    def __init__(self, runner: ModelRunner, allocator: PageAllocator, max_num_seqs: int, chunk_size: int):
        self.runner = runner
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def pages_for(self, seq: Sequence) -> int:
        return pages_needed(seq.max_total_tokens, self.runner.page_size)

    def add(self, seq: Sequence) -> None:
        if self.pages_for(seq) > self.allocator.num_usable:
            raise ValueError(f"a sequence of up to {seq.max_total_tokens} tokens needs {self.pages_for(seq)} KV pages "
                             f"but the cache has {self.allocator.num_usable}; lower max_tokens or raise the KV budget")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> None:
        for seq in [s for s in self.waiting if s.request_id == request_id]:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._release(seq)

    def step(self) -> list[tuple[Sequence, str]]:
        """Runs one device step; returns (sequence, new text) for every sequence that got a token."""
        self._admit()
        if not self.running:
            return []
        prefilling = next((s for s in self.running if s.in_prefill), None)
        if prefilling is not None:
            return self._prefill_chunk(prefilling)
        return self._decode(list(self.running))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.pages_for(seq) > self.allocator.num_free:
                break
            self.waiting.popleft()
            seq.pages = self.allocator.allocate(self.pages_for(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _prefill_chunk(self, seq: Sequence) -> list[tuple[Sequence, str]]:
        start = seq.num_cached
        chunk = seq.prompt_token_ids[start:start + self.chunk_size]
        out = self.runner.prefill(Row(chunk, start, seq.pages, seq.sampling_row()))
        seq.num_cached += len(chunk)
        if seq.in_prefill:
            return []  # a middle chunk: its sampled token is not a prediction anyone asked for
        return self._append([seq], out)

    def _decode(self, seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        # A decoding sequence has sampled at least once (its last prefill chunk did): its newest token is an output.
        rows = [Row([s.output_token_ids[-1]], s.num_tokens - 1, s.pages, s.sampling_row()) for s in seqs]
        out = self.runner.decode(rows)
        for s in seqs:
            s.num_cached += 1
        return self._append(seqs, out)

    def _append(self, seqs: list[Sequence], out: dict) -> list[tuple[Sequence, str]]:
        changed = []
        for i, seq in enumerate(seqs):
            top = list(zip(out["top_ids"][i].tolist(), out["top_logprobs"][i].tolist())) if seq.params.logprobs else []
            delta = seq.append_token(int(out["tokens"][i]), float(out["logprobs"][i]), int(out["ranks"][i]), top)
            changed.append((seq, delta))
            if seq.finish_reason is not None:
                self._release(seq)
        return changed

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED
        self.running.remove(seq)
