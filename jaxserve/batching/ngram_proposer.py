"""N-gram (prompt lookup) proposals: no model, only the sequence's own tokens.

Where the output repeats the input (code edits, rewriting, extraction, quoting) the tokens after an earlier
occurrence of the last few tokens are a good guess of what comes next, and a guess costs nothing but a lookup.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, trying n from
    max_n down to min_n (a longer match is the better predictor). token_ids: the whole sequence so far."""
    tokens = np.asarray(token_ids, np.int64)  # [L]
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # Windows that start before the suffix itself and end early enough to have a token after them.
        windows = sliding_window_view(tokens[:L - 1], n)  # [L - n, n]: windows[i] = tokens[i:i + n]
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n  # the most recent occurrence: the likeliest to continue the same way
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Proposals by prompt lookup, each time from the sequence as it stands (nothing kept between steps)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k, self.max_n, self.min_n = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min

    def available(self, seq) -> list[int]:
        """What it would propose for `seq` from the tokens the host has (a token still in flight is missed)."""
        return propose_ngram(seq.token_ids[:len(seq.token_ids)], self.k, self.max_n, self.min_n)

    def propose(self, plan) -> None:
        """Fills plan.proposals for the sequences the plan granted proposals, up to the number granted."""
        for seq, k in plan.num_draft.items():
            plan.proposals[seq] = self.available(seq)[:k]
