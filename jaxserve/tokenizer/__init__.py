"""Tokenizer (BPE on the `tokenizers` library: byte-level, or SentencePiece-style for Gemma), chat templates and
streaming detokenization.

- `core`: `Tokenizer`, built from a GGUF file's metadata (`gguf_vocab`) or a HF directory (`hf_files`); the
  characters a token can stand for at most (`length_bound`), and how tokens spell bytes (`alphabet`).
- `chat_template`: the jinja environment chat templates render in; `--chat-template` files.
- `detokenizer`: `IncrementalDetokenizer`, token ids to text deltas for streaming.
"""
from jaxserve.tokenizer.chat_template import read_chat_template
from jaxserve.tokenizer.core import Tokenizer, check_unicode
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "check_unicode", "read_chat_template"]
