"""A GGUF file's `tokenizer.*` metadata as a `tokenizers` BPE: byte-level (the `gpt2` model, with the pre-tokenizer
`tokenizer.ggml.pre` names), or Gemma's SentencePiece vocabulary spelled as the BPE of its tokenizer.json."""
from __future__ import annotations

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


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
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


def gemma_bpe(tokens: list[str], unk_id: int | None) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
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


def gguf_tokenizer_args(reader) -> dict:
    """`Tokenizer`'s arguments from a `gguf.GGUFReader`'s `tokenizer.*` metadata: byte-level BPE, or Gemma's
    SentencePiece."""
    def get(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    kind = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = byte_level_bpe(tokens, get("tokenizer.ggml.merges", []), get("tokenizer.ggml.pre", "default"))
        vocab = None
    elif kind == "llama" and get("general.architecture", "").startswith("gemma"):
        tok, vocab = gemma_bpe(tokens, get("tokenizer.ggml.unknown_token_id"))
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
    return dict(tok=tok, bos_token_id=get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=[i for i in eos if i is not None],
                add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                chat_template=get("tokenizer.chat_template"))
