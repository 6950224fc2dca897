"""The runner's side of the penalties' counts kept on device (`jaxserve.sample.penalty_counts`): the counts
themselves, made at the first row that asks for a penalty (a server that never sees one keeps none and compiles
nothing for them), and which sequence's tokens each slot holds, up to where, so that a step sends a row's history
only when its slot does not hold it already.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.batch import StepInput
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

    def place(self, rows: list[Row]) -> list[Row]:
        """rows as the step sends them: a penalty row whose slot holds its tokens up to its start sends no history
        (past_tokens None); the others start their slot over from theirs (penalty_init). Where a penalty row has no
        slot (rows made by hand), the step counts every row's history instead: `counts` then gives None."""
        asking = [r for r in rows if r.sampling.past_tokens is not None]
        if not asking:
            return rows
        if not self.keep_counts or any(r.sampling.penalty_slot < 0 for r in asking):  # the step counts histories
            for r in asking:
                self._held.pop(r.sampling.penalty_slot, None)
            return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, penalty_slot=-1)) for r in rows]
        placed = []
        for r in rows:
            s = r.sampling
            if s.past_tokens is None:
                placed.append(r)
                continue
            held = self._held.get(s.penalty_slot)
            synced = held is not None and held[0] is s.past_tokens and held[1] == r.start_pos
            # A row with proposals counts them all: its slot must start over at its next step.
            if r.num_draft:
                self._held.pop(s.penalty_slot, None)
            else:
                self._held[s.penalty_slot] = (s.past_tokens, r.end)
            sampling = dataclasses.replace(s, past_tokens=None) if synced else dataclasses.replace(s, penalty_init=True)
            placed.append(dataclasses.replace(r, sampling=sampling))
        return placed

    def counts(self, batch: StepInput) -> PenaltyCounts | None:
        """The counts a step over batch takes (made at the first that needs them): None where no row counts in a
        slot (no penalty, or rows without slots: the step then counts each row's past_tokens). A multi-process
        follower, which places no rows, decides by its batch too."""
        if not np.any(np.asarray(batch.sampling.penalty_slot) >= 0):
            return None
        if self.state is None:
            self.state = empty_counts(self.num_slots, self.vocab_size)
            if self.mesh is not None:
                self.state = jax.device_put(self.state, replicated(self.mesh))
        return self.state
