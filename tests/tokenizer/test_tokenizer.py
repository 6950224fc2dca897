import json

import gguf
import pytest
import tokenizers
import transformers
from tokenizers import AddedToken, decoders, models, normalizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxserve.openai.responses import chat_logprobs
from jaxserve.outputs import CompletionOutput, Logprob
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.weights.gguf import open_gguf

from locations import DATA

REFERENCE = json.loads((DATA / "smollm2_greedy.json").read_text())

VARIED = [
    "Numbers: 3.14159, 1,000,000 and 2024-06-01T12:00:00Z; 42nd street.",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x!r}')\r\n",
    "Ünïcödé naïve café — 東京は日本の首都です。 한국어 Привет, мир! ∑∫√π",
    "Emoji: 👍🏽 🎉 🇫🇷 👨‍👩‍👧 ❤️",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|><file_sep>",
    "   leading,  double  spaces \n\n\n trailing   ",
    "I'm sure they'll say WE'VE can't DON'T",
]


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    return Tokenizer.from_gguf_fields(open_gguf(default_gguf_path))


@pytest.fixture(scope="module")
def hf_tok(default_gguf_path):
    return transformers.AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.add_bos is REFERENCE["add_bos"] is False
    assert tok.eos_token_ids[0] == REFERENCE["eos_token_id"] == 2  # <|im_end|> first: it names the template's eos_token
    assert tok.id_to_token(1) == "<|im_start|>"


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_reference_prompt_ids(tok, case):
    if case["messages"]:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=True)
        assert text == case["prompt"]
        assert tok.encode(text, add_special_tokens=False) == case["prompt_token_ids"]
    assert tok.encode(case["prompt"]) == case["prompt_token_ids"]


def test_matches_hf(tok, hf_tok):
    for text in VARIED:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_parsed_and_skipped(tok):
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 3
    assert tok.decode(ids) == "user"


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer(tok, skip):
    text = "Hi 👋🏽! 東京タワー 🇯🇵🎌 naïve ∑ <|im_end|> done 😀"
    ids = tok.encode(text)
    # The test only means something if some tokens end inside a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert "" in deltas  # held back while a character was incomplete


def test_token_bytes(tok):
    # " 🎉" is three tokens: the space with the emoji's first two bytes, then one byte each.
    ids = tok.encode(" 🎉")
    assert [tok.decode([i]) for i in ids] == [" \ufffd", "\ufffd", "\ufffd"]
    assert [tok.token_bytes(i) for i in ids] == [b" \xf0\x9f", b"\x8e", b"\x89"]
    for text in VARIED:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), text
    # Every token, against transformers' copy of the byte-level alphabet.
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    for i in range(tok.vocab_size):
        assert tok.token_bytes(i) == bytes(byte_of[c] for c in tok.id_to_token(i)), i


def test_token_bytes_sentencepiece():
    """A tokenizer.json in SentencePiece style: '▁' for spaces, <0xNN> tokens for bytes outside the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)},
             "▁": 258, "H": 259, "i": 260, "!": 261, "▁H": 262, "▁Hi": 263}
    inner = tokenizers.Tokenizer(models.BPE(vocab, [("▁", "H"), ("▁H", "i")], unk_token="<unk>", byte_fallback=True))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    inner.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    t = Tokenizer(inner, bos_token_id=1, eos_token_ids=[], add_bos=True, chat_template=None)
    ids = t.encode("Hi 東!")
    assert ids[:2] == [1, 263] and len(ids) == 7  # <s>, "▁Hi", "▁", three bytes of 東, "!"
    assert b"".join(t.token_bytes(i) for i in ids) == "<s> Hi 東!".encode()


def test_chat_logprobs_bytes(tok):
    ids = tok.encode(" 🎉")
    out = CompletionOutput(0, " 🎉", ids, None, [{i: Logprob(-0.5, 1)} for i in ids])

    def token_text(i):  # as the server writes `token`
        return tok.decode([i], skip_special_tokens=False)
    content = chat_logprobs(out, token_text, 1, tok.token_bytes)["content"]
    assert [c["token"] for c in content] == [" \ufffd", "\ufffd", "\ufffd"]  # as vLLM: the token's decoded text
    assert [c["bytes"] for c in content] == [[32, 0xF0, 0x9F], [0x8E], [0x89]]
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
    # Without a tokenizer the token is its id, and its bytes are the id's text.
    assert chat_logprobs(out, str, 0)["content"][0]["bytes"] == list(str(ids[0]).encode())


def test_chat_template_errors(tok):
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer(tok._tok, bos_token_id=None, eos_token_ids=[], add_bos=False,
                  chat_template="{{ raise_exception('roles must alternate') }}").apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok._tok, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None) \
            .apply_chat_template([{"role": "user", "content": "hi"}])


def test_save_round_trip(tok, tmp_path):
    tok.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for attr in ("vocab_size", "bos_token_id", "eos_token_ids", "add_bos", "chat_template"):
        assert getattr(back, attr) == getattr(tok, attr), attr
    messages = [{"role": "user", "content": "Hello"}]
    assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in VARIED:
        ids = tok.encode(text)
        assert back.encode(text) == ids
        assert hf.encode(text) == ids  # the saved directory is a valid HF tokenizer too
        assert back.decode(ids) == tok.decode(ids)


def test_from_hf_dir_defaults(tok, tmp_path):
    """A HF directory without an add_bos_token flag: BOS comes from tokenizer.json's post-processor."""
    from tokenizers import processors
    tok.save(tmp_path)
    inner = tok._tok.__class__.from_file(str(tmp_path / "tokenizer.json"))
    inner.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    inner.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]
    cfg["bos_token"] = {"content": "<|im_start|>", "special": True}
    cfg["chat_template"] = [{"name": "default", "template": "{{ bos_token }}x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    back = Tokenizer.from_hf_dir(tmp_path)
    assert back.add_bos and back.bos_token_id == 1 and back.eos_token_ids == [2, 7]
    assert back.encode("a") == [1] + tok.encode("a")
    assert back.apply_chat_template([]) == "<|im_start|>x"


def _write_gguf(path, tokenizer_model="gpt2", pre="qwen2"):
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab", "<|im_end|>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(path)


def test_other_pre_tokenizer(tmp_path):
    t = Tokenizer.from_gguf_fields(_write_gguf(tmp_path / "t.gguf"))
    assert t.encode("abab<|im_end|>") == [2, 2, 3]
    assert t.eos_token_ids == [3] and t.bos_token_id is None and not t.add_bos


def test_unsupported_tokenizers(tmp_path):
    with pytest.raises(ValueError, match="SentencePiece"):
        Tokenizer.from_gguf_fields(_write_gguf(tmp_path / "spm.gguf", tokenizer_model="llama"))
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_fields(_write_gguf(tmp_path / "pre.gguf", pre="mystery"))
