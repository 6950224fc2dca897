"""The OpenAI-compatible server: the official client on the default model, raw HTTP for every bad input, auth,
admission (429), disconnects, metrics, a failed step, SIGTERM, and a bounded soak."""
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from jaxserve import SamplingParams
from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS

from fake_runner import fake_llm, has_decode_row
from serving import ServerThread, free_port, metric_samples, wait_idle
from tiny import make_llm

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def real(default_llm):
    """The default model behind the server, for the official client."""
    st = ServerThread(default_llm, "SmolLM2-135M-Instruct")
    yield st
    st.stop()


@pytest.fixture(scope="module")
def tiny():
    """An engine over a fake runner (token-id prompts; each token's successor is the next id), with an API key and
    a small queue: the server's own behaviour, with tokens worked out by hand."""
    st = ServerThread(fake_llm(max_num_seqs=4, max_model_len=64, vocab_size=320), "tiny", api_key=KEY,
                      max_queued_requests=4)
    yield st
    st.stop()


def client(st, **kw):
    from openai import OpenAI
    return OpenAI(base_url=st.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


# ---- the official client, default model ----

def test_completions_with_the_openai_client(real):
    c = client(real)
    assert [m.id for m in c.models.list().data] == ["SmolLM2-135M-Instruct"]
    prompt = "The capital of France is"
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
    tok = real.engine.llm.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Streamed: the same greedy text in pieces, then the usage.
    chunks = list(c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_stop_strings_n_seed_and_logprobs(real):
    c = client(real)
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Count: one, two, three,", max_tokens=20,
                             temperature=0, stop=[" five"])
    assert r.choices[0].finish_reason == "stop" and "five" not in r.choices[0].text
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8, temperature=0,
                             logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens) == r.choices[0].text
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # the top 2 and the chosen token (often one of them)
    assert all(max(t.values()) == pytest.approx(x, abs=1e-4) for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8, n=3,
                             temperature=1.0, seed=7)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    again = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8, n=3,
                                 temperature=1.0, seed=7)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seeded: reproducible


def test_stop_strings_are_never_sent_and_ban_lists_fit(real):
    """A stop string that spans tokens is not sent in part (whole or streamed: the text is held back until it cannot
    match); and a request banning every ending token under min_tokens (two EOS ids + the most stop ids) runs beside
    a streaming one without failing either (it used to overflow the ban list and fail the whole step)."""
    c = client(real)
    prompt = "The capital of France is"
    free = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
    assert free.choices[0].text.startswith(" Paris.\n\nThe answer")
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                             stop=["\n\nThe answer"])
    assert r.choices[0].text == " Paris." and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                             stop=["\n\nThe answer"], logprobs=0)
    lp = r.choices[0].logprobs  # offsets count every token's text, held back from the stream or not
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                                       stop=["\n\nThe answer"], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == " Paris."

    async def both():
        streaming = asyncio.create_task(_completion(real, {"prompt": "Once upon a time", "max_tokens": 24,
                                                           "temperature": 0, "stream": True}))
        await asyncio.sleep(0.3)
        banning = await _completion(real, {"prompt": "hi", "max_tokens": 8, "min_tokens": 8,
                                           "stop_token_ids": list(range(100, 100 + MAX_STOP_TOKEN_IDS))})
        return await streaming, banning

    streamed, banned = asyncio.run(both())
    assert streamed.status_code == 200 and b"[DONE]" in streamed.content and b'"error"' not in streamed.content
    assert banned.status_code == 200 and banned.json()["usage"]["completion_tokens"] == 8, banned.text
    too_many = list(range(100, 101 + MAX_STOP_TOKEN_IDS))
    assert asyncio.run(_completion(real, {"prompt": "hi", "stop_token_ids": too_many})).status_code == 400
    wait_idle(real)


async def _completion(st, body):
    return await _request("POST", st.url + "/v1/completions", body)


def test_a_batch_of_prompts(real):
    """A list of prompts is a batch: choice k * n + i is prompt k's i-th sample, usage sums them, streamed or not."""
    c = client(real)
    prompts = ["The capital of France is", "Two plus two equals"]
    alone = [c.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=6, temperature=0)
             for p in prompts]
    r = c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # once per prompt, as OpenAI
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = ["", ""]
    for chunk in c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts, max_tokens=6, temperature=0,
                                      stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [a.choices[0].text for a in alone]
    wait_idle(real)


def test_chat_with_the_openai_client(real):
    c = client(real)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=0,
                                  logprobs=True, top_logprobs=2)
    answer = r.choices[0].message
    assert answer.role == "assistant" and "Paris" in answer.content
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    # Each token's own bytes (a token may hold part of a character): together, exactly the answer's UTF-8 (and the
    # ending token's, which is not part of the text).
    spoken = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content)
    assert spoken.startswith(answer.content.encode()) and spoken.endswith(b"<|im_end|>")
    stream = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == answer.content
    wait_idle(real)


def test_serving_benchmark_script_runs(real, tmp_path):
    out = tmp_path / "serving.json"
    r = subprocess.run([sys.executable, "scripts/bench_serving.py", "--base-url", real.url + "/v1", "--num-requests",
                        "4", "--request-rates", "inf", "--prompt-len", "16", "--output-len", "6", "--ttft-slo", "30",
                        "--server-metrics", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["runs"][0]
    assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == 24, row
    # The server's own split of TTFT, over this load's four requests only: inside the client's.
    server = row["server_mean_s"]
    assert 0 <= server["queue"] < server["ttft"] <= row["mean_s"]["ttft"], row
    wait_idle(real)


# ---- refusing a prompt by its length ----

def test_the_length_bound_never_refuses_a_prompt_that_fits(default_gguf_path):
    """A text of L characters is refused unread only if it cannot encode to fewer than L / max_chars_per_token
    tokens: checked on the default model's own vocabulary with the texts that pack the most characters into a
    token (its longest tokens repeated), and on what normalizers and pre-tokenizers may do."""
    import random

    import gguf
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Inner

    from jaxserve.tokenizer import Tokenizer
    from jaxserve.tokenizer.alphabet import BYTE_OF_CHAR
    from jaxserve.tokenizer.gguf_vocab import byte_level_bpe, gemma_bpe
    tok = Tokenizer.from_gguf_fields(gguf.GGUFReader(default_gguf_path))
    assert tok.max_chars_per_token == 81  # "\n" and 80 spaces
    longest = sorted(range(tok.vocab_size), key=lambda i: -len(tok.token_bytes(i)))[:200]
    rng = random.Random(0)
    texts = [tok.decode([i] * 50, skip_special_tokens=False) for i in longest]
    texts += ["".join(tok.decode([rng.choice(longest)], skip_special_tokens=False) for _ in range(50))
              for _ in range(50)]
    texts += ["".join(chr(rng.choice([rng.randrange(32, 0x2FF), rng.randrange(0x4E00, 0x9FFF),
                                      rng.randrange(0x1F300, 0x1FAFF)])) for _ in range(2000)) for _ in range(5)]
    texts += [" " * 5000, "\n" * 5000, "9" * 5000, "<|im_start|>" * 100]
    # Characters whose bytes the vocabulary lacks vanish (it has no unknown token): they count for nothing.
    texts += ["a" + "\x04" * 10_000 + "b", "a" + "\U00050000" * 1000 + "b"]
    for text in texts:
        assert len(tok.encode(text, add_special_tokens=False)) >= tok.min_tokens(text) > 0, text[:40]

    def made(inner):
        return Tokenizer(inner, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None)
    alphabet = [*BYTE_OF_CHAR, "aa", "aaaa"]
    assert made(byte_level_bpe(alphabet, ["a a", "aa aa"], "gpt2")).max_chars_per_token == 4
    # NFC composes up to 4 characters into one (here 3 jamo into one syllable, 3 bytes): 4 x the longest spelling.
    nfc = made(byte_level_bpe(alphabet, ["a a", "aa aa"], "qwen2"))
    assert nfc.max_chars_per_token == 16
    jamo = "\u1100\u1161\u11a8" * 1000
    assert len(nfc.encode(jamo)) == 3000 >= nfc.min_tokens(jamo)
    # Gemma's SentencePiece: '▁' per space, every byte as a <0xNN> piece, so unknown characters are never fused.
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "a", "\u2581a", "\u2581" * 5]
    gemma = made(gemma_bpe(pieces, 0)[0])
    assert gemma.max_chars_per_token == 6
    for text in (" " * 1000, " a" * 500, "\u00e9" * 1000):
        assert len(gemma.encode(text)) >= gemma.min_tokens(text)
    # Where text can vanish or fold into one token, no bound: a prompt is then tokenized to be measured.
    fused = Inner(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert made(fused).max_chars_per_token is None and made(fused).min_tokens("b" * 1000) == 0
    dropping = Inner(models.BPE({"a": 0}, []))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert made(dropping).max_chars_per_token is None
    stripping = Inner(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>"))
    stripping.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    assert made(stripping).max_chars_per_token is None
    stripping.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    assert made(stripping).max_chars_per_token == 5  # "<unk>", one per unknown character
    # A vocabulary that cannot spell a character and has no unknown token drops it: "a" + 10k "é" + "b" is 2 tokens.
    unspelled = Inner(models.BPE({"a": 0, "b": 1}, []))
    assert len(unspelled.encode("a" + "\u00e9" * 10_000 + "b").ids) == 2
    assert made(unspelled).max_chars_per_token is None
    # An added token with rstrip (Phi-3's <|end|>) swallows the whitespace after it, however long.
    swallowing = Inner(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>"))
    swallowing.add_special_tokens([AddedToken("<|end|>", rstrip=True)])
    assert len(swallowing.encode("<|end|>" + " " * 10_000 + "a").ids) <= 2
    assert made(swallowing).max_chars_per_token is None


def test_a_megabyte_prompt_is_refused_untokenized(real, monkeypatch):
    """512 tokens of context: a 1 MB prompt (over a second to tokenize) is a 400 naming the limit, never tokenized."""
    tok, calls = real.server.default.tokenizer, []
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: calls.append(len(text)))
    r = asyncio.run(_completion(real, {"prompt": "hello " * 166_000, "max_tokens": 4}))
    assert r.status_code == 400 and "maximum context length is 512 tokens" in r.json()["error"]["message"]
    assert calls == []


# ---- raw HTTP, tiny model ----

class Reply:
    def __init__(self, status, headers, content):
        self.status_code, self.headers, self.content = status, headers, content
        self.is_success = 200 <= status < 300

    @property
    def text(self):
        return self.content.decode()

    def json(self):
        return json.loads(self.content)


async def _request(method, url, json_body=None, data=None, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=json_body, data=data, headers=headers) as r:
            return Reply(r.status, dict(r.headers), await r.read())


def http(method, url, json_body=None, data=None, headers=None) -> Reply:
    return asyncio.run(_request(method, url, json_body, data, headers))


def post(st, path, body=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http("POST", st.url + path, body, headers=headers)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": [1, 2, 3], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": [1, 2, 3], "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo or prompt_logprobs
    ({"prompt": [1, 2, 3], "max_tokens": -3}, 400, None),
    ({"prompt": [1, 2, 3], "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, 2, 3], "temperature": 5}, 400, "temperature"),
    ({"prompt": [1, 2, 3], "top_p": 0}, 400, None),
    ({"prompt": [1, 2, 3], "n": True}, 400, "n"),
    # Logit controls: out of range, too many, not token ids, outside the vocabulary (320), no tokenizer.
    ({"prompt": [1, 2, 3], "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"prompt": [1, 2, 3], "presence_penalty": "high"}, 400, "presence_penalty"),
    ({"prompt": [1, 2, 3], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": [1, 2, 3], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": [1, 2, 3], "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"prompt": [1, 2, 3], "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ({"prompt": [1, 2, 3], "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ({"prompt": [1, 2, 3], "logit_bias": {"320": 1}}, 400, "logit_bias"),
    ({"prompt": [1, 2, 3], "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": [1, 2, 3], "allowed_token_ids": [7, 999999]}, 400, "allowed_token_ids"),
    ({"prompt": [1, 2, 3], "bad_words": "word"}, 400, "bad_words"),
    ({"prompt": [1, 2, 3], "bad_words": ["word"]}, 400, "bad_words"),  # the fake model has no tokenizer
    ({"prompt": [1, 2, 3], "temprature": 0.5}, 400, "temprature"),  # unknown field
    ({"prompt": [1, 2, 3], "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [[1, 2], "b", []]}, 400, "prompt"),
    ({"prompt": [[1, 2]] * 65}, 400, "prompt"),
    ({"prompt": [1] * 70}, 400, None),  # longer than max_model_len (64)
    ({"prompt": [1, 2, 3], "max_tokens": 100}, 400, None),  # prompt + max_tokens past max_model_len
    ({"prompt": [999999]}, 400, None),  # not a token of this vocabulary
    ({"prompt": [1, 2, 3], "model": "gpt-4"}, 404, "model"),
    ({"prompt": [1, 2, 3], "top_k": 10 ** 10}, 400, None),  # past int32: refused, not a failed engine step
    ({"prompt": [1, 2, 3], "min_tokens": 1, "stop_token_ids": [2 ** 40]}, 400, None),
    ({"prompt": [1, 2, 3], "max_completion_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1, 2, 3], "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": [1, 2, 3], "echo": "yes"}, 400, "echo"),
    ({"prompt": [1, 2, 3], "n": 0}, 400, None),
    ({"prompt": [1, 2, 3], "n": 5, "temperature": 1}, 400, "n"),  # more than one request may ask for (4)
    ({"prompt": [1, 2, 3], "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": [1, 2, 3], "tools": [{"type": "function"}]}, 400, "tools"),
])
def test_bad_requests_get_openai_errors(tiny, body, status, param):
    r = post(tiny, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_malformed_bodies_and_routes(tiny):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for raw in [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 100000 + b"]" * 100000]:
        r = http("POST", tiny.url + "/v1/completions", data=raw, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"], raw[:20]
    r = http("POST", tiny.url + "/v1/completions", data=b'{"prompt": [1]}',
             headers={**headers, "Content-Type": "application/json; charset=bogus"})
    assert r.status_code == 400
    # Neutral values of fields the engine does not implement are fine.
    r = post(tiny, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "text"},
                                       "metadata": {"who": "test"}, "store": False, "presence_penalty": 0})
    assert r.status_code == 200, r.text
    r = post(tiny, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]  # the tiny model has none
    assert http("GET", tiny.url + "/v1/completions", headers=headers).status_code == 405
    r = http("GET", tiny.url + "/v1/nothing", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["message"]
    wait_idle(tiny)


def test_api_key(tiny):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    assert post(tiny, "/v1/completions", body, key=None).status_code == 401
    assert post(tiny, "/v1/completions", body, key="sk-wrong").status_code == 401
    raw_header = http("POST", tiny.url + "/v1/completions", body, headers={"Authorization": "Bearer \udcff"})
    assert raw_header.status_code == 401  # a header that is not UTF-8: refused, not a 500
    assert http("GET", tiny.url + "/v1/models").status_code == 401
    assert post(tiny, "/v1/completions", body).status_code == 200
    # Anthropic's header is taken on every route, as Authorization is
    assert http("POST", tiny.url + "/v1/completions", body, headers={"x-api-key": KEY}).status_code == 200
    assert http("POST", tiny.url + "/v1/completions", body, headers={"x-api-key": "sk-wrong"}).status_code == 401
    assert http("GET", tiny.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert http("GET", tiny.url + "/health").status_code == 200  # open, for load balancers


async def _stream(url, body, key=KEY, disconnect_after=None, on_first_chunk=None):
    """(status, chunks as parsed JSON, ended with [DONE]); closes the connection after `disconnect_after` chunks."""
    import aiohttp
    chunks, done = [], False
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={**body, "stream": True},
                          headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status != 200:
                return r.status, [await r.json()], False
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[6:]))
                if on_first_chunk is not None and len(chunks) == 1:
                    on_first_chunk()
                if disconnect_after is not None and len(chunks) >= disconnect_after:
                    break  # leaving the block drops the connection
    return r.status, chunks, done


def test_a_client_that_disconnects_frees_its_pages(tiny):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 50, "ignore_eos": True, "temperature": 0}
    status, chunks, done = asyncio.run(_stream(tiny.url, body, disconnect_after=3))
    assert status == 200 and len(chunks) == 3 and not done
    wait_idle(tiny)  # aborted: nothing runs, every page is free


def test_429_when_the_queue_is_full(tiny):
    """16 at once against room for 8 sequences (4 running + 4 queued), the engine held meanwhile so none can finish
    early: 8 are refused with 429, not queued, and the 8 admitted complete once it goes on."""
    import threading
    body = {"prompt": [5, 6, 7], "max_tokens": 10, "ignore_eos": True}
    runner, go = tiny.engine.llm.runner, threading.Event()
    runner.gate = go

    async def burst():
        tasks = [asyncio.create_task(_request("POST", tiny.url + "/v1/completions", body,
                                              headers={"Authorization": f"Bearer {KEY}"})) for _ in range(16)]
        deadline = time.monotonic() + 60
        while sum(t.done() for t in tasks) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        go.set()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(burst())
    finally:
        go.set()
        runner.gate = None
    statuses = [r.status_code for r in results]
    assert statuses.count(429) == 8 and statuses.count(200) == 8, statuses
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert all(r.json()["usage"]["completion_tokens"] == 10 for r in results if r.status_code == 200)
    wait_idle(tiny)


def test_a_failed_step_answers_500_and_the_server_goes_on(tiny):
    tiny.engine.llm.runner.fail("dispatch", has_decode_row)
    r = post(tiny, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5})
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    r = post(tiny, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    wait_idle(tiny)


def test_metrics_after_traffic(tiny):
    for _ in range(3):
        assert post(tiny, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}).is_success
    samples = metric_samples(http("GET", tiny.url + "/metrics").text)

    def value(metric, **labels):
        return samples[metric, frozenset(f'{k}="{v}"' for k, v in {"model_name": "tiny", **labels}.items())]
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "time_per_output_token_seconds"):
        assert value(f"jaxserve:{h}_count") >= 3 and value(f"jaxserve:{h}_sum") > 0, h
    assert value("jaxserve:time_per_output_token_seconds_count") >= 15  # 5 gaps per 6-token request
    assert value("jaxserve:generation_tokens_total") >= 18 and value("jaxserve:prompt_tokens_total") >= 4
    assert value("jaxserve:request_success_total", finished_reason="length") >= 3
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
              "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert value(f"jaxserve:{g}") >= 0, g
    assert value("jaxserve:prefix_cache_hits_total") <= value("jaxserve:prefix_cache_queries_total")


def test_speculative_server_streams_the_plain_tokens_and_counts(tiny_dir):
    """A server whose engine verifies a draft's proposals every step: whole and streamed completions give plain
    decoding's tokens (compared by their logprobs: the tiny model has no tokenizer), and /metrics carries vLLM's
    spec-decode counters."""
    prompt = [5, 6, 7, 8, 9]
    out = make_llm(tiny_dir, max_model_len=64).generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)[0].outputs[0]
    plain = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
    spec = dict(method="draft_model", model=tiny_dir, num_speculative_tokens=3, adaptive=False)
    st = ServerThread(make_llm(tiny_dir, max_model_len=64, speculative_config=spec), "tiny")
    try:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        whole = post(st, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
        assert whole == pytest.approx(plain, abs=1e-4)
        streamed = post(st, "/v1/completions", {**body, "stream": True}).text
        chunks = [json.loads(line[6:])["choices"] for line in streamed.splitlines() if line.startswith("data: {")]
        assert [lp for c in chunks if c for lp in c[0]["logprobs"]["token_logprobs"]] == pytest.approx(plain, abs=1e-4)
        text = http("GET", st.url + "/metrics").text
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total"):
            assert re.search(rf'^jaxserve:{name}{{model_name="tiny"}} [1-9]', text, re.M), name
        assert re.search(r'^jaxserve:spec_decode_num_accepted_tokens_per_pos_total'
                         r'\{model_name="tiny",position="2"\} [1-9]', text, re.M), text
        wait_idle(st)
    finally:
        st.stop()


def test_soak_concurrent_streams_with_random_disconnects(tiny_dir):
    """A few hundred streamed requests, 24 at a time (8 running, the rest queued), a third dropped mid-stream: no
    5xx, every completed response well formed, no page leaked."""
    st = ServerThread(make_llm(tiny_dir, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32), "tiny",
                      api_key=KEY, max_queued_requests=32)
    try:
        _soak(st)
    finally:
        st.stop()


def _soak(tiny):
    seed = random.randrange(1 << 30)
    print(f"soak seed {seed}")  # shown when the test fails
    rng = random.Random(seed)

    async def one(i):
        await asyncio.sleep(rng.random() * 0.2)
        n = rng.randint(1, 12)
        body = {"prompt": [rng.randrange(1, 300) for _ in range(rng.randint(1, 30))], "max_tokens": n,
                "ignore_eos": True, "temperature": rng.choice([0, 0.8]), "stream_options": {"include_usage": True}}
        drop = rng.randint(1, n) if rng.random() < 0.33 else None
        status, chunks, done = await _stream(tiny.url, body, disconnect_after=drop)
        return status, chunks, done, n, drop

    async def soak():
        sem = asyncio.Semaphore(24)

        async def limited(i):
            async with sem:
                return await one(i)
        return await asyncio.gather(*[limited(i) for i in range(300)])

    results = asyncio.run(soak())
    assert all(status == 200 for status, *_ in results), [r[0] for r in results]
    completed = [(chunks, n) for status, chunks, done, n, drop in results if drop is None]
    assert len(completed) > 100 and all(done for _, _, done, _, drop in results if drop is None)
    for chunks, n in completed:
        assert chunks[-1]["usage"]["completion_tokens"] == n and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    wait_idle(tiny)


@pytest.mark.parametrize("grace,max_tokens,finishes", [(20, 60, True), (0, 240, False)])
def test_sigterm_finishes_running_requests_then_exits_0(tiny_dir, grace, max_tokens, finishes):
    """SIGTERM mid-stream in a real `jaxserve serve`: the request finishes within the grace period, or is cut off
    with an error event when the grace period runs out; either way the server exits 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--model", tiny_dir, "--port", str(port),
                             "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                             "--block-size", "16", "--no-warmup", "--shutdown-grace-period", str(grace)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if http("GET", url + "/health").status_code == 200:
                    break
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

        body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        start = time.monotonic()
        status, chunks, done = asyncio.run(_stream(url, body, key=None,
                                                   on_first_chunk=lambda: proc.send_signal(signal.SIGTERM)))
        assert status == 200 and done
        if finishes:
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        else:
            assert "error" in chunks[-1] and len(chunks) < max_tokens
            assert time.monotonic() - start < grace + 15
        assert proc.wait(60) == 0
        with pytest.raises(aiohttp.ClientError):
            http("GET", url + "/health")
    finally:
        proc.kill()


def test_cli_serve_rejects_bad_options(tiny_dir):
    from jaxserve.cli import main
    assert main(["serve", "--model", tiny_dir, "--port", "0"]) == 1
    assert main(["serve", "--model", tiny_dir, "--max-queued-requests", "-1"]) == 1
