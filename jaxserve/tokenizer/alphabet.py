"""How vocabulary tokens spell bytes: GPT-2's byte-level alphabet, and SentencePiece's byte-fallback tokens.

Read by `Tokenizer.token_bytes` (a token's own bytes) and by the length bound (which bytes a vocabulary can spell).
"""
from __future__ import annotations

import re

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the rest for U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return alphabet


BYTE_OF_CHAR = _byte_level_alphabet()
