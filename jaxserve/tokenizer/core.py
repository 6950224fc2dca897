"""The tokenizer one model serves: text <-> token ids on the `tokenizers` library, a token's own bytes, the chat
template's rendering, and a floor on a text's token count.

One class serves GGUF files (vocabulary in the metadata, `gguf_vocab`) and HF directories (tokenizer.json,
`hf_files`); `save` writes the latter so a converted checkpoint carries its tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import tokenizers

from jaxserve.tokenizer.alphabet import BYTE_OF_CHAR, BYTE_TOKEN
from jaxserve.tokenizer.chat_template import jinja_env
from jaxserve.tokenizer.gguf_vocab import gguf_tokenizer_args
from jaxserve.tokenizer.hf_files import hf_tokenizer_args
from jaxserve.tokenizer.length_bound import length_bound


def check_unicode(text: str, what: str = "the text") -> None:
    """ValueError naming `what` if `text` holds a lone surrogate (JSON's "\\ud800" escape decodes to one): no UTF-8
    spells it, so it can be neither tokenized nor matched."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate (U+{ord(text[e.start]):04X} "
                         f"at character {e.start})") from None


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        decoder = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else {}
        self._decoders = {d.get("type") for d in decoder.get("decoders", [decoder])}
        added = tok.get_added_tokens_decoder()
        self._added = set(added)
        self._special = frozenset(i for i, t in added.items() if t.special)
        self._bytes: dict[int, bytes] = {}
        self.max_chars_per_token, self._dropped = length_bound(tok)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template, self._template = template, None  # compiled on first use

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens (BOS, EOS, chat-turn markers): matched whole in a prompt, never spelled by text."""
        return self._special

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprob `bytes`), which may be part of a UTF-8 character: decoding such
        a token alone gives U+FFFD instead."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        token = self._tok.id_to_token(token_id)
        if token is None:  # model vocabularies may be padded past the tokenizer's; decode gives "" for these too
            return b""
        if token_id in self._added:  # matched in the text as written, not in the model's alphabet
            return token.encode()
        if "ByteLevel" in self._decoders:
            try:
                return bytes(BYTE_OF_CHAR[c] for c in token)
            except KeyError:  # the ByteLevel decoder's own rule: a token outside the alphabet is its UTF-8
                return token.encode()
        if "ByteFallback" in self._decoders and (byte := BYTE_TOKEN.fullmatch(token)):
            return bytes([int(byte[1], 16)])
        return token.replace("\u2581", " ").encode()  # SentencePiece writes spaces as '▁'

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; control tokens written in the text (`<|im_start|>`) become their single ids.

        Encode a rendered chat template with add_special_tokens=False: templates write their own BOS.
        """
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized in a worker thread
        # then leaves the server's event loop free.
        try:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:
            check_unicode(text, "the prompt")  # the library's TypeError does not say what is wrong
            raise
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def min_tokens(self, text: str) -> int:
        """A floor on len(encode(text)), from its length alone (0 where the vocabulary gives no bound)."""
        if not self.max_chars_per_token:
            return 0
        kept = len(text) - (len(self._dropped.findall(text)) if self._dropped is not None else 0)
        return -(-kept // self.max_chars_per_token)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the model's template; extra keyword arguments (tools=...) become template
        variables."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        try:
            if self._template is None:
                self._template = jinja_env().from_string(self.chat_template)
            bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
            eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos or "", eos_token=eos or "", **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None

    @classmethod
    def from_gguf_fields(cls, reader) -> Tokenizer:
        """Build from a `gguf.GGUFReader`'s `tokenizer.*` metadata: byte-level BPE, or Gemma's SentencePiece."""
        return cls(**gguf_tokenizer_args(reader))

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """Build from a HF model directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        return cls(**hf_tokenizer_args(path))

    def save(self, path) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json (the eos ids) into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))

        def name(i):
            return self.id_to_token(i) if i is not None else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_token_id),
               "eos_token": name(self.eos_token_ids[0]) if self.eos_token_ids else None,
               "add_bos_token": self.add_bos, "add_eos_token": False,
               # HF's default space clean-up would make its decode differ from ours.
               "clean_up_tokenization_spaces": False, "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False), encoding="utf-8")
        gen = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_ids}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=1), encoding="utf-8")
