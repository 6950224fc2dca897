"""Our tokenizer as llguidance sees it: every token's bytes, which are control tokens, and how text tokenizes.

llguidance builds its token trie from the bytes each token stands for (`Tokenizer.token_bytes`: byte-level BPE's
alphabet undone, SentencePiece's '▁' as a space and its <0xNN> byte-fallback pieces as single bytes), so one bridge
serves every vocabulary we load (GGUF or HF directory). Control tokens are marked with a leading 0xFF byte, as
llguidance's own bridges do: a grammar never spells them with text, only names them (<|im_end|>) or allows them as
EOS. Ids past the tokenizer's vocabulary (a model's padded embedding) are empty tokens, which no grammar allows.

Building one reads the whole vocabulary (about 0.4 s for 49k tokens, 2 s for Gemma's 262k), so it is built on first
use and kept per tokenizer and vocabulary size.
"""
from __future__ import annotations

import threading
import weakref

import llguidance

from jaxserve.tokenizer import Tokenizer

_CONTROL_PREFIX = b"\xff"  # llguidance's mark of a special token
_bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {vocab_size: LLTokenizer}
_lock = threading.Lock()  # requests are compiled on several threads: the first builds, the others wait for it


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, special ids, and a tokenize function."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        special = tokenizer.special_token_ids
        self.tokens = [_CONTROL_PREFIX + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        # llguidance hands over valid UTF-8 (it tokenizes a trailing partial character itself).
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of `tokenizer` (which has an EOS token) for a model of `vocab_size` logits (built
    once, then cached)."""
    with _lock:
        per_size = _bridges.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size))
            per_size[vocab_size] = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size,
                                                          eos_token=list(tokenizer.eos_token_ids))
        return per_size[vocab_size]
