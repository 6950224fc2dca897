"""Token masks: which tokens a row may sample, one bit per token.

The layout llguidance fills and the peers use: int32 [ceil(V / 32)] per row, bit j of word i is token 32 i + j,
1 = allowed; a word of -1 allows all 32 of its tokens. Built on the host (a grammar's next-token set, a request's
allowed_token_ids or bad_words) and applied on device by `jaxserve.sample.sampling.masked`.
"""
from __future__ import annotations

import numpy as np


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allow_all(vocab_size: int) -> np.ndarray:
    return np.full(num_words(vocab_size), -1, np.int32)


def allowing(token_ids, vocab_size: int) -> np.ndarray:
    """Only `token_ids` allowed."""
    words = np.zeros(num_words(vocab_size), np.uint32)
    ids = np.asarray(list(token_ids), np.int64)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def forbidding(mask: np.ndarray, token_ids) -> np.ndarray:
    """A copy of `mask` with `token_ids` forbidden too."""
    words = mask.view(np.uint32).copy()
    ids = np.asarray(list(token_ids), np.int64)
    np.bitwise_and.at(words, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """The tokens both masks allow (None: a mask that allows every token)."""
    return b if a is None else a if b is None else a & b


def allowed_ids(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a mask allows (for tests and error messages)."""
    bits = (mask.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # [W, 32]
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])
