"""One sequence's place in its grammar, and the next-token masks of many sequences filled at once.

A matcher is advanced only on the tokens a sequence emits (the output processor's `take` of each token), so it
always stands after the sequence's last emitted token: a preempted sequence recomputed from its tokens, or a
verification step that rejects proposals, never has to roll it back.
"""
from __future__ import annotations

import threading

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.sample.token_mask import num_words


class GrammarMatcher:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar refused it (or had failed before: see `error`)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Nothing may follow but EOS: the output is complete."""
        return self._matcher.is_stopped()

    @property
    def failed(self) -> bool:
        """The grammar failed, for good: a token it refused, or a per-step limit it ran into while computing a mask.
        llguidance's mask then allows only EOS, as if the output were complete: `jaxserve.batching.step_rows`
        empties it instead, so the sequence ends with an error, not "stop"."""
        return self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the grammar failed ('' if it has not), with llguidance's parser state and the grammar itself."""
        return self._matcher.get_error()

    @property
    def error_line(self) -> str:
        """The first line of `error`: what a log needs (the rest holds the grammar, up to the request's size)."""
        return self.error.split("\n", 1)[0][:500]

    def allows(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar would take from here (the matcher does not advance)."""
        return self._matcher.validate_tokens(token_ids)

    @property
    def forced_bytes(self) -> bytes:
        """The bytes the grammar forces next (b'' if it leaves a choice). Where some are forced, the mask allows
        the token that spells most of them, not the shorter ones that spell less (llguidance keeps tokenizing
        them as the tokenizer would)."""
        return self._matcher.compute_ff_bytes()


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            # llguidance's own threads (80% of the cores, up to 32), which fill the masks without the GIL: the rest
            # of the host (the server's event loop) runs meanwhile.
            _executor = llguidance.LLExecutor()
        return _executor


def fill_masks(matchers: list[GrammarMatcher]) -> np.ndarray:
    """Each matcher's next-token mask, computed in parallel: int32 [len(matchers), ceil(V / 32)] in
    `jaxserve.sample.token_mask`'s layout (llguidance's own)."""
    masks = np.empty((len(matchers), num_words(matchers[0].vocab_size)), np.int32)  # [R, W]
    llguidance.numpy.fill_next_token_bitmask_par(_pool(), [(m._matcher, i) for i, m in enumerate(matchers)], masks)
    return masks
