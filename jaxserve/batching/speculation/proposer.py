"""Speculative decoding's proposers, as the engine loop sees them: guesses of each sequence's next tokens.

`NgramProposer` looks them up in the sequence itself; `DraftProposer` runs a small model. Either is asked only for
the sequences a scheduled batch granted proposals (`ScheduledBatch.num_draft`), and never writes a sequence: what it
learned of one (how far a draft model's cache got) goes back to the scheduler in its `Proposals`.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxserve.batching.sequence import Sequence


@dataclasses.dataclass
class Proposals:
    tokens: dict[Sequence, list[int]]  # at most as many per sequence as the batch granted it
    # A draft model's: per sequence, tokens whose K/V the draft now holds in its own cache (same pages).
    draft_cached: dict[Sequence, int] = dataclasses.field(default_factory=dict)


class Proposer(Protocol):
    def available(self, seq: Sequence) -> list[int] | None:
        """What it would propose for `seq` now, or None if it can always propose (a model): the controller's cue
        to speculate for a sequence at all."""

    def propose(self, batch) -> Proposals:
        """Proposals for the sequences `batch` (a ScheduledBatch) granted them, up to the number granted."""
