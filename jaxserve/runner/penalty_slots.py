"""The runner's side of the penalties' counts kept on device (`jaxserve.sample.penalty_counts`): the counts
themselves, passed to every step (one program whether a row has a penalty or not), and which sequence's tokens each
slot holds, up to where, so that a step sends a row's history only when its slot does not hold it already.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.parallel.mesh import replicated
from jaxserve.runner.batch_builder import Row
from jaxserve.sample.penalty_counts import PenaltyCounts, empty_counts


class PenaltySlots:
    def __init__(self, num_slots: int, vocab_size: int, mesh=None, keep_counts: bool = True):
        """num_slots: the runner's slots of sampled tokens (`last_tokens`, its padding slot included). keep_counts
        False: every step counts its rows' histories (a speculative head, whose steps carry no counts)."""
        self.num_slots, self.vocab_size, self.mesh, self.keep_counts = num_slots, vocab_size, mesh, keep_counts
        self.state: PenaltyCounts | None = None
        # slot -> (the sequence's token array, the tokens counted in: [0, end)). The array is the sequence's own
        # (`Sequence.token_ids_array`): held here, its identity is never reused by another sequence while listed.
        self._held: dict[int, tuple[np.ndarray, int]] = {}

    def place(self, rows: list[Row], split: bool = False) -> list[Row]:
        """rows as the step sends them: a penalty row whose slot holds its tokens up to its start sends no history
        (past_tokens None); the others start their slot over from theirs (penalty_init). A penalty row without a slot
        (rows made by hand) keeps its history, which the step counts instead; a split step (`split`), whose sampling
        half reads no history, takes none such."""
        asking = [r for r in rows if r.sampling.past_tokens is not None]
        if not asking:
            return rows
        if not self.keep_counts:  # every step counts its rows' histories
            return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, penalty_slot=-1)) for r in rows]
        if split and any(r.sampling.penalty_slot < 0 for r in asking):
            raise ValueError("a split step's rows with penalties must have slots (their counts are kept by slot)")
        return [self._placed(r) if r.sampling.past_tokens is not None and r.sampling.penalty_slot >= 0 else r
                for r in rows]

    def _placed(self, r: Row) -> Row:
        s = r.sampling
        assert s.past_tokens is not None  # a penalty row's
        held = self._held.get(s.penalty_slot)
        synced = held is not None and held[0] is s.past_tokens and held[1] == r.start_pos
        # A row with proposals counts them all: its slot must start over at its next step.
        if r.num_draft:
            self._held.pop(s.penalty_slot, None)
        else:
            self._held[s.penalty_slot] = (s.past_tokens, r.end)
        sampling = dataclasses.replace(s, past_tokens=None) if synced else dataclasses.replace(s, penalty_init=True)
        return dataclasses.replace(r, sampling=sampling)

    def counts(self) -> PenaltyCounts | None:
        """The counts every step takes (None where the runner keeps none): one program for steps with and without
        penalties, so none compiles when the first penalty comes. Made at the first step ([slots, V] int32 and
        bool: 16 MB for 65 slots of a 49k vocabulary, 85 MB for a 262k one)."""
        if not self.keep_counts:
            return None
        if self.state is None:
            self.state = empty_counts(self.num_slots, self.vocab_size)
            if self.mesh is not None:
                self.state = jax.device_put(self.state, replicated(self.mesh))
        return self.state
