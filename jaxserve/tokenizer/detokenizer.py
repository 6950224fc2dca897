"""Streaming detokenization: token ids in, text deltas out."""
from __future__ import annotations

from jaxserve.tokenizer.core import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits half a UTF-8 character (vLLM-style prefix/read
    offsets).

    Each step decodes only the ids since the last emitted text (plus the window before it, so that decoders that
    depend on context, like spaces after a word, see it) instead of the whole sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already in `text`
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix:self._read], self._skip)
        new_text = decode(self._ids[self._prefix:], self._skip)
        # A trailing U+FFFD means the last token ended inside a multi-byte character: wait for the rest of it.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
