"""Tokenizer (BPE on the `tokenizers` library: byte-level, or SentencePiece-style for Gemma), chat templates and
streaming detokenization.

One class serves GGUF files (vocabulary in the metadata) and HF directories (tokenizer.json); `save` writes the
latter so a converted checkpoint carries its tokenizer.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# Split regexes of the pre-tokenizers named by `tokenizer.ggml.pre`, as in llama.cpp and the models' tokenizer.json.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# pre name -> (pre-tokenizer factory, normalizer factory or None, BPE ignore_merges)
_PRE_TOKENIZERS = {
    "default": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, False),
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, False),
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
               None, False),
    # Llama 3's tokenizer.json sets ignore_merges: a whole pre-token found in the vocabulary is taken as is.
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
}

# Control tokens llama.cpp treats as end of generation whatever eos_token_id says (chat turns end with them).
_END_OF_TURN = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                "<|end_of_text|>", "<EOT>"}
_CONTROL, _USER_DEFINED = 3, 4  # gguf token_type values
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the rest for U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as HF renders them).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_PRE_TOKENIZERS)}")
    make_pre, make_norm, ignore_merges = _PRE_TOKENIZERS[pre]
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                          [tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges))
    tok.pre_tokenizer = make_pre()
    if make_norm:
        tok.normalizer = make_norm()
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma_bpe(tokens: list[str], unk_id: int | None) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """Gemma's SentencePiece vocabulary as the BPE tokenizer of its tokenizer.json (transformers' GemmaTokenizer):
    spaces become '▁', no prefix space, unknown characters fall back to <0xNN> byte tokens.

    The GGUF has no merges; as transformers does, they are every split of a token into two vocabulary tokens,
    ranked by the token's position in the vocabulary (Gemma's scores do not follow its merge order), longer left
    piece first. Tokens of two or more spaces are stored as real spaces: spell them '▁' so the merges reach them.
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        for cut in range(len(token) - 1, 0, -1):
            if token[:cut] in vocab and token[cut:] in vocab:
                merges.append((token[:cut], token[cut:]))
    unk = tokens[unk_id] if unk_id is not None else None
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def check_unicode(text: str, what: str = "the text") -> None:
    """ValueError naming `what` if `text` holds a lone surrogate (JSON's "\\ud800" escape decodes to one): no UTF-8
    spells it, so it can be neither tokenized nor matched."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate (U+{ord(text[e.start]):04X} "
                         f"at character {e.start})") from None


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


def _length_bound(tok: tokenizers.Tokenizer) -> tuple[int | None, re.Pattern | None]:
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
            dropped = _unspellable({_BYTE_OF_CHAR[c] for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab})
            if dropped is False:
                return no_bound
    shrink = _shrink(state(tok.normalizer))
    return (None, None) if shrink is None else (shrink * max(map(len, vocab), default=1), dropped)


def read_chat_template(path) -> str:
    """A jinja chat template file's text (`--chat-template`); ValueError naming the file if it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        _jinja_env().from_string(text)  # a syntax error shows now, not at the first chat request
    except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as e:
        raise ValueError(f"cannot use chat template file {path}: {e}") from None
    return text


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
        self.max_chars_per_token, self._dropped = _length_bound(tok)

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
                return bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:  # the ByteLevel decoder's own rule: a token outside the alphabet is its UTF-8
                return token.encode()
        if "ByteFallback" in self._decoders and (byte := _BYTE_TOKEN.fullmatch(token)):
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
        """Render `messages` with the model's template; extra keyword arguments (tools=...) become template variables."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        try:
            if self._template is None:
                self._template = _jinja_env().from_string(self.chat_template)
            bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
            eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos or "", eos_token=eos or "", **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None

    @classmethod
    def from_gguf_fields(cls, reader) -> "Tokenizer":
        """Build from a `gguf.GGUFReader`'s `tokenizer.*` metadata: byte-level BPE, or Gemma's SentencePiece."""
        def get(key, default=None):
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        kind = get("tokenizer.ggml.model")
        tokens = get("tokenizer.ggml.tokens")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, get("tokenizer.ggml.merges", []), get("tokenizer.ggml.pre", "default"))
            vocab = None
        elif kind == "llama" and get("general.architecture", "").startswith("gemma"):
            tok, vocab = _gemma_bpe(tokens, get("tokenizer.ggml.unknown_token_id"))
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: jaxserve reads byte-level BPE ('gpt2') "
                             "vocabularies and Gemma's SentencePiece ('llama'), not other SentencePiece or others")
        # Without these, control tokens written in a prompt would be cut into ordinary pieces.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        # As transformers does, a user-defined token is matched whole only if the model's vocabulary spells it so
        # (Gemma's runs of spaces, stored as real spaces, are not: they are reached through '▁' merges instead).
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and (vocab is None or t in vocab)])
        eos = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _END_OF_TURN]
        return cls(tok, bos_token_id=get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=[i for i in eos if i is not None],
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Build from a HF model directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(token):  # tokenizer_config writes special tokens as strings or as AddedToken dicts
            token = token.get("content") if isinstance(token, dict) else token
            return tok.token_to_id(token) if token else None

        bos = token_id(cfg.get("bos_token"))
        if bos is None:
            bos = gen.get("bos_token_id")
        gen_eos = gen.get("eos_token_id")
        eos = [token_id(cfg.get("eos_token"))] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: BOS is added iff tokenizer.json's post-processor adds it
            add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():  # newer transformers save the template beside the config
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(tok, bos_token_id=bos, eos_token_ids=[i for i in eos if i is not None],
                   add_bos=bool(add_bos), chat_template=template)

    def save(self, path) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json (the eos ids) into `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        name = lambda i: self.id_to_token(i) if i is not None else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_token_id),
               "eos_token": name(self.eos_token_ids[0]) if self.eos_token_ids else None,
               "add_bos_token": self.add_bos, "add_eos_token": False,
               # HF's default space clean-up would make its decode differ from ours.
               "clean_up_tokenization_spaces": False, "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False), encoding="utf-8")
        gen = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_ids}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=1), encoding="utf-8")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits half a UTF-8 character (vLLM-style prefix/read offsets).

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
