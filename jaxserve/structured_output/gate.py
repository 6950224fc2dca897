"""Where a grammar starts: after a reasoning model's end tag (`StructuredOutputsParams.starts_after`), as vLLM's
structured output waits for its reasoning parser's `reasoning_ended`. Until the tag's tokens have been emitted the
sequence samples freely (no mask, its matcher not advanced); from the token after them its grammar applies."""
from __future__ import annotations


class GrammarGate:
    """Watches a sequence's emitted tokens for `after` (the end tag's ids, in order)."""

    def __init__(self, after: list[int]):
        self.after = tuple(after)
        self.recent: list[int] = []  # the last len(after) tokens emitted

    def passes(self, token_id: int) -> bool:
        """Takes the next emitted token; True once the tokens so far end with the tag: the grammar applies from the
        next token on."""
        self.recent = (self.recent + [token_id])[-len(self.after):]
        return tuple(self.recent) == self.after
