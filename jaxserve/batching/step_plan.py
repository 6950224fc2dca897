"""What the scheduler hands the engine for one step (cf. vLLM v1's `core/sched/output.py`): who decodes, which
prompt chunks run, the proposals to verify, the pages the step fills and the KV to import before it, and the rows it
lays out for the runner. The scheduler (`jaxserve.batching.scheduler`) builds it; the engine dispatches its rows and
hands it back, with the step's results, to `Scheduler.update`.
"""
from __future__ import annotations

import dataclasses

from jaxserve.batching.sequence import Sequence
from jaxserve.cache.transfer import KVPages
from jaxserve.runner.batch_builder import Row


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int  # first token of the chunk (tokens before it are cached)
    length: int

    @property
    def is_last(self) -> bool:
        """The chunk reaches the sequence's end, so its sampled token is the next one."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclasses.dataclass
class Write:
    """Tokens of a sequence whose K/V a step writes: published to the prefix cache only after the step has
    completed, and only if the sequence was not preempted since (its pages went back)."""
    seq: Sequence
    end: int  # tokens of it cached once the step has run
    num_preemptions: int  # its preemption count when the step was scheduled


@dataclasses.dataclass
class Load:
    """Pages a sequence found in the host tier (`jaxserve.cache.host_tier`): loaded into its fresh pages before the
    step; dropped if it was preempted since it was admitted (its pages went back)."""
    seq: Sequence
    pages: list[int]
    keys: list[bytes]
    num_preemptions: int


@dataclasses.dataclass
class ScheduledBatch:
    decode: list[Sequence]  # one token each, and any proposals after it
    prefill: list[Chunk]  # at most one chunk per sequence
    # Speculative decoding: how many proposals a decoding sequence has pages and budget for, then the proposals
    # themselves (at most that many; see jaxserve.batching.speculation.proposer).
    num_draft: dict[Sequence, int] = dataclasses.field(default_factory=dict)
    proposals: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)
    writes: list[Write] = dataclasses.field(default_factory=list)
    # The step's rows, laid out once the batch is complete: decode rows, then prompt chunks.
    rows: list[Row] = dataclasses.field(default_factory=list)
    constrained: bool = False  # a row samples under a grammar: the next step needs this one's tokens to plan
    # Sequences under a grammar whose row's input token is still in flight: their masks are filled once the step
    # before is read back, and joined on device before the rows sample (a split step: `jaxserve.batching.engine_core`).
    masks_later: list[Sequence] = dataclasses.field(default_factory=list)
    # Sequences prefilled elsewhere and admitted now: (the sequence, its first pages, the KV to write there before
    # the step).
    imports: list[tuple[Sequence, list[int], KVPages]] = dataclasses.field(default_factory=list)
    # Host tier: (page, content) of the pages evicted while planning, to export to the host before the step (and
    # before any load or import into them), and the host pages to load into fresh ones.
    stores: list[tuple[int, tuple]] = dataclasses.field(default_factory=list)
    loads: list[Load] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    def drop(self, request_ids: set[str]) -> None:
        """Takes these requests' rows out, before the step is dispatched (their sequences were taken out since)."""
        def kept(seq: Sequence) -> bool:
            return seq.request_id not in request_ids
        self.rows = [row for row, seq in zip(self.rows, self.row_seqs) if kept(seq)]
        self.decode = [s for s in self.decode if kept(s)]
        self.prefill = [c for c in self.prefill if kept(c.seq)]
        self.num_draft = {s: k for s, k in self.num_draft.items() if kept(s)}
        self.proposals = {s: p for s, p in self.proposals.items() if kept(s)}
        self.writes = [w for w in self.writes if kept(w.seq)]
        self.imports = [i for i in self.imports if kept(i[0])]
        self.loads = [load for load in self.loads if kept(load.seq)]
        self.masks_later = [s for s in self.masks_later if kept(s)]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(self.num_draft.values()) + sum(c.length for c in self.prefill)

    @property
    def row_seqs(self) -> list[Sequence]:
        """Each row's sequence, in the rows' order."""
        return self.decode + [c.seq for c in self.prefill]
