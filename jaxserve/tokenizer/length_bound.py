"""A floor on a text's token count from its length alone: the most characters one token of a vocabulary can stand
for, read from the `tokenizers` pipeline's description (normalizer, pre-tokenizer, model). It lets the server refuse
a prompt certainly past max_model_len without tokenizing it."""
from __future__ import annotations

import json
import re

import tokenizers
from tokenizers import models, pre_tokenizers

from jaxserve.tokenizer.alphabet import BYTE_OF_CHAR

# How much shorter a normalizer may make a text, in characters; one not listed here gives no bound. NFC composes at
# most 4 characters into one (a canonical decomposition is at most 4 long, and composition is frozen by Unicode's
# stability policy); NFD, NFKD, Lowercase, Prepend and a Replace by something as long only lengthen or keep it.
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that split or re-spell the text without dropping any of it (unless told to remove what they split
# on). Whitespace, BertPreTokenizer and the like drop characters: no bound.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation", "UnicodeScripts"}


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for n in normalizer["normalizers"]:
            f = _shrink(n)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = normalizer["pattern"].get("String"), normalizer["content"]
        return None if pattern is None or not content else -(-len(pattern) // len(content))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(map(_keeps_text, pre["pretokenizers"]))
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _has_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(map(_has_byte_level, pre["pretokenizers"]))
    return pre.get("type") == "ByteLevel"


_NEVER_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}


def _unspellable(missing: set[int]) -> re.Pattern | None | bool:
    """The characters a byte-level vocabulary drops (no unknown token) for want of the `missing` bytes, as a regex
    character class (None: there are none); False where they are no few ranges (a continuation byte is missing).
    A lead byte's range is taken whole (its shorter code points too): counting more characters as dropped only
    lowers the floor."""
    ranges = []
    for b in sorted(missing - _NEVER_IN_UTF8):
        if 0x80 <= b < 0xC0:
            return False
        shift, bits = (0, 0x7F) if b < 0x80 else (6, 0x1F) if b < 0xE0 else (12, 0x0F) if b < 0xF0 else (18, 0x07)
        ranges.append(((b & bits) << shift, ((b & bits) << shift) + (1 << shift) - 1))
    if not ranges:
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]")


def length_bound(tok: tokenizers.Tokenizer) -> tuple[int | None, re.Pattern | None]:
    """The most characters of a text that one token can stand for (None where no bound holds), and the characters
    the vocabulary drops unseen, which count for nothing: a text with more of the others than max_model_len times
    that bound is certainly too long, found without tokenizing it.

    A token covers a piece of the normalized text no longer than its vocabulary spelling: one symbol per byte in a
    byte-level vocabulary (a character is at least a byte), a character per character in SentencePiece's (a '▁' per
    space, a <0xNN> piece for at most one character), an added token's content as written. So the longest spelling
    bounds it, times what the normalizer may shorten the text by; provided nothing is dropped (pre-tokenizer,
    truncation, a character the vocabulary cannot spell when there is no unknown token), no run of unknown
    characters folds into one token (BPE's fuse_unk) and no added token swallows the whitespace beside it (lstrip /
    rstrip)."""
    def state(component):
        return None if component is None else json.loads(component.__getstate__())

    no_bound = None, None
    model = tok.model
    pre = state(tok.pre_tokenizer)
    if not isinstance(model, models.BPE) or tok.truncation is not None or not _keeps_text(pre):
        return no_bound
    if any(t.lstrip or t.rstrip for t in tok.get_added_tokens_decoder().values()):
        return no_bound
    vocab = tok.get_vocab(with_added_tokens=True)
    dropped = None
    if not (model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))):
        if model.fuse_unk and model.unk_token is not None:
            return no_bound
        if model.unk_token is None:  # what the vocabulary cannot spell vanishes
            if not _has_byte_level(pre):
                return no_bound
            dropped = _unspellable({BYTE_OF_CHAR[c] for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab})
            if dropped is False:
                return no_bound
    shrink = _shrink(state(tok.normalizer))
    return (None, None) if shrink is None else (shrink * max(map(len, vocab), default=1), dropped)
