"""N-gram (prompt lookup) proposals: no model, only the sequence's own tokens.

Where the output repeats the input (code edits, rewriting, extraction, quoting) the tokens after an earlier
occurrence of the last few tokens are a good guess of what comes next, and a guess costs nothing but a lookup.
The controller asks every decoding sequence every step, so a lookup must cost microseconds, not a scan of the
sequence: each sequence keeps an index of where each of its n-grams last ended, extended by the new tokens only.
"""
from __future__ import annotations

import weakref

from jaxserve.batching.speculation.proposer import Proposals


class NgramIndex:
    """For one sequence: for each n-gram (min_n <= n <= max_n) the position just after its latest occurrence that
    is not the sequence's own suffix. `lookup` proposes up to k tokens that followed the latest earlier occurrence
    of the last n tokens, n from max_n down to min_n (a longer match is the better predictor; the most recent
    occurrence the likeliest to continue alike)."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `after`

    def lookup(self, k: int) -> list[int]:
        tokens = self.tokens
        L = len(tokens)
        # Index every n-gram that ends before the last token: the suffix itself must not find itself.
        for end in range(self.indexed, L - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.after[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = self.after.get(tuple(tokens[L - n:]))
            if at is not None:
                return tokens[at:at + k]
        return []


class NgramProposer:
    """Proposals by prompt lookup, from the sequence as the host has it."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k, self.max_n, self.min_n = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def available(self, seq) -> list[int]:
        """What it would propose for `seq` now (a token still in flight is not in the lookup yet)."""
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.max_n, self.min_n)
            index.tokens = list(seq.prompt_token_ids)
        # A sequence only grows while it lives: the index takes its new tokens.
        index.tokens += seq.output_token_ids[len(index.tokens) - len(seq.prompt_token_ids):]
        return index.lookup(self.k)

    def propose(self, batch) -> Proposals:
        """Proposals for the sequences `batch` (a ScheduledBatch) granted them, up to the number granted."""
        return Proposals({seq: self.available(seq)[:k] for seq, k in batch.num_draft.items()})
