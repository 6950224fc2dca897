"""One client must never hurt another (issue 11), over raw sockets against a tiny-model server with 1 s limits: a
stream nobody reads, a request head or body sent a byte at a time, one request asking for more than the batch, a
huge prompt to tokenize. Each is cut off or refused in bounded time, holds no capacity afterwards, and the server
answers everyone else meanwhile."""
import http.client
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from jaxserve.cli import main
from jaxserve.server import Server

from serving import ServerThread, wait_idle
from tiny import make_llm

KEY = "sk-hostile"
LIMIT = 1.0  # the test server's header, body and stream-write timeouts, seconds
# Repeated in every streamed event, so that 800 events (13 MB) outgrow loopback's socket buffers: with a 4 KiB client
# receive buffer the server's writes blocked after 2.9 MB here (its send buffer autotunes up to tcp_wmem's 4 MiB).
NAME = "tiny-" + "x" * 16000


@pytest.fixture(scope="module")
def st(tiny_dir):
    """Room for 8 sequences (4 running, 4 queued), at most 4 per request; compiled up front so that the time bounds
    below measure the server, not XLA."""
    server = ServerThread(make_llm(tiny_dir, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32,
                                   warmup=True), NAME, api_key=KEY, max_queued_requests=4,
                          stream_write_timeout_s=LIMIT, header_timeout_s=LIMIT, body_timeout_s=LIMIT)
    yield server
    server.stop()


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever the environment


def call(st, method, path, body=None, key=KEY, timeout=30.0):
    """A well-behaved client: (status, headers, JSON body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with _opener.open(urllib.request.Request(st.url + path, data, headers, method=method), timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def connect(st, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connecting: the window scale is agreed in the handshake
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", st.port))
    return s


def wait_for(condition, timeout: float, what: str) -> float:
    """Seconds until condition() held; fails after timeout."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.01)
    return time.monotonic() - start


# ---- a stream nobody reads ----

def test_a_stream_nobody_reads_is_cut_off_and_gives_its_capacity_back(st):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "n": 4, "ignore_eos": True, "stream": True}).encode()
    s = connect(st, rcvbuf=4096)
    try:
        s.sendall(head("/v1/completions", len(body)) + body)  # and never reads
        wait_for(lambda: st.server.in_flight == 4, 30, "the stream was never admitted")
        # Meanwhile the others are served.
        status, _, reply = call(st, "POST", "/v1/completions", {"prompt": [4, 5], "max_tokens": 3})
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        # ~800 events of 16 KB: the writes block, and after LIMIT the server gives up on this client.
        wait_for(lambda: st.server.in_flight == 0, 15 * LIMIT, "a client that stopped reading kept its capacity")
        wait_idle(st)
        # Reset, not closed behind the megabytes still queued for it.
        s.settimeout(10)
        with pytest.raises(ConnectionResetError):
            while s.recv(1 << 20):
                pass
    finally:
        s.close()
    status, _, reply = call(st, "POST", "/v1/completions", {"prompt": [1, 2, 3], "n": 4, "max_tokens": 5,
                                                            "ignore_eos": True})
    assert status == 200 and reply["usage"]["completion_tokens"] == 20
    wait_idle(st)


# ---- slow request heads and bodies ----

@pytest.mark.parametrize("trickle", [False, True])
def test_a_request_head_that_never_completes_is_closed(st, trickle):
    """Half a request line then nothing, or headers trickled one line at a time: closed after the header timeout."""
    s = connect(st)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" if trickle else b"POST /v1/compl")
        s.settimeout(0.2)
        start, closed = time.monotonic(), False
        while not closed and time.monotonic() - start < LIMIT + 10:
            try:
                if trickle:
                    s.sendall(b"X-Slow: 1\r\n")
                closed = s.recv(65536) == b""
            except TimeoutError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                closed = True
        assert closed, "a connection that never sent a whole request head is still open"
        assert LIMIT * 0.5 < time.monotonic() - start < LIMIT + 5
    finally:
        s.close()
    assert call(st, "GET", "/health")[0] == 200


def test_a_trickled_body_gets_408_and_holds_no_capacity(st):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "user": "slow" * 10}).encode()
    s = connect(st)
    try:
        start = time.monotonic()
        s.sendall(head("/v1/completions", len(body)) + body[:5])
        # Meanwhile the others are served, and the slow one holds nothing.
        assert call(st, "POST", "/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200
        assert st.server.in_flight == 0
        for byte in body[5:]:  # a byte every 0.2 s: 15 s for the whole body
            if select.select([s], [], [], 0.2)[0]:  # answered (or closed)
                break
            s.sendall(bytes([byte]))
        s.settimeout(5)
        reply = http.client.HTTPResponse(s)
        reply.begin()
        assert reply.status == 408 and json.loads(reply.read())["error"]["message"]
        assert time.monotonic() - start < LIMIT + 5
    finally:
        s.close()
    assert st.server.in_flight == 0
    assert call(st, "POST", "/v1/completions", {"prompt": [4, 5], "max_tokens": 2})[0] == 200


# ---- the size of a request ----

@pytest.mark.parametrize("prompt,n", [([1, 2, 3], 4), ([[1, 2], [3, 4]], 2)])
def test_one_request_may_not_take_more_than_the_batch(st, prompt, n):
    """Room for 8, but no more than 4 (max_num_seqs) in one request (n x prompts): the rest stays for the others."""
    status, _, reply = call(st, "POST", "/v1/completions", {"prompt": prompt, "n": n + 1, "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "n" and "4" in reply["error"]["message"], reply
    status, _, reply = call(st, "POST", "/v1/completions", {"prompt": prompt, "n": n, "max_tokens": 2})
    assert status == 200 and len(reply["choices"]) == 4
    wait_idle(st)


def test_the_request_bound_is_configurable(st, tiny_dir):
    def bound(**args):
        return Server(st.engine, "x", **args).models["x"].max_request_sequences
    assert bound() == 4  # the engine's max_num_seqs
    assert bound(max_request_sequences=2) == 2
    # Never more than the server admits at all (4 running + 1 queued).
    assert bound(max_queued_requests=1, max_request_sequences=100) == 5
    for flag, value in [("--max-request-sequences", "0"), ("--stream-write-timeout", "0"),
                        ("--header-timeout", "-1"), ("--body-timeout", "0")]:
        assert main(["serve", "--model", tiny_dir, flag, value]) == 1, flag


# ---- a huge prompt ----

class SlowTokenizer:
    """Stands in for a tokenizer (the tiny model has none) on a 1 MiB prompt: encode() takes until `release` is set,
    outside the GIL, as native tokenizer code can."""

    def __init__(self):
        self.calls, self.release = [], threading.Event()  # calls: the length of each text encoded

    def encode(self, text, add_special_tokens=True):
        self.calls.append(len(text))  # atomic: two threads encode at once
        self.release.wait(10)
        return [1, 2, 3, 4]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def token_bytes(self, token_id):
        return str(token_id).encode()


@pytest.mark.parametrize("chat", [False, True])
def test_a_huge_prompt_is_admitted_first_and_tokenized_off_the_event_loop(st, chat):
    """Two 1 MB prompts taking all 8 places: while they tokenize /health answers at once, and a third request is
    refused (429, or 400 past the per-request bound) without being tokenized."""
    tok, results = SlowTokenizer(), []
    text = "a" * 1_000_000  # near aiohttp's 1 MiB body limit
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}) if chat else
                  ("/v1/completions", {"prompt": text}))
    body = {**body, "n": 4, "max_tokens": 2}
    threads = [threading.Thread(target=lambda: results.append(call(st, "POST", path, body))) for _ in range(2)]
    st.server.default.tokenizer, tokenizer = tok, st.server.default.tokenizer
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(tok.calls) == 2, 10, "both huge prompts should be tokenizing")
        assert st.server.in_flight == 8  # reserved before tokenizing
        start = time.monotonic()
        assert call(st, "GET", "/health", timeout=5)[0] == 200
        assert time.monotonic() - start < 2.0  # not after the tokenizing (10 s at most, here)
        assert call(st, "POST", path, body)[0] == 429
        status, _, reply = call(st, "POST", path, {**body, "n": 5})
        assert status == 400 and reply["error"]["param"] == "n"
        assert tok.calls == [len(text)] * 2
    finally:
        tok.release.set()
        for t in threads:
            t.join(30)
        st.server.default.tokenizer = tokenizer
    assert [r[0] for r in results] == [200, 200], results
    wait_idle(st)


def test_a_client_that_leaves_while_its_prompt_is_tokenized_holds_its_place_until_the_work_is_done(st):
    """Sending a long prompt and leaving must not free the place while a thread still tokenizes it: else a client
    could pile up tokenizing work without bound by sending and leaving."""
    tok = SlowTokenizer()
    body = json.dumps({"prompt": "a" * 100_000, "n": 4, "max_tokens": 2}).encode()
    st.server.default.tokenizer, tokenizer = tok, st.server.default.tokenizer
    try:
        s = connect(st)
        s.sendall(head("/v1/completions", len(body)) + body)
        wait_for(lambda: len(tok.calls) == 1, 10, "the prompt should be tokenizing")
        s.close()  # the client leaves; its handler is cancelled
        time.sleep(0.3)
        assert st.server.in_flight == 4  # still held: the tokenizer is at work
        tok.release.set()
        wait_for(lambda: st.server.in_flight == 0, 10, "the place was never given back")
    finally:
        tok.release.set()
        st.server.default.tokenizer = tokenizer
    wait_idle(st)


def tiny_tokenizer(calls: list | None = None):
    """A byte-level BPE inside the tiny model's vocabulary (its 256 bytes, then "aa" and "aaaa": at most 4
    characters a token), with a chat template that writes the contents alone; `calls` gets each encoded text's
    length."""
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.tokenizer.alphabet import BYTE_OF_CHAR
    from jaxserve.tokenizer.gguf_vocab import byte_level_bpe
    tok = Tokenizer(byte_level_bpe([*BYTE_OF_CHAR, "aa", "aaaa"], ["a a", "aa aa"], "gpt2"), bos_token_id=None,
                    eos_token_ids=[], add_bos=False,
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if calls is not None:
        encode = tok.encode

        def counted(text, add_special_tokens=True):
            calls.append(len(text))
            return encode(text, add_special_tokens)
        tok.encode = counted
    return tok


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_certainly_too_long_is_refused_before_it_is_tokenized(st, chat):
    """256 tokens of context, 16 to generate, at most 4 characters a token: 961 characters are certainly too many
    (a 400 naming the limit, nothing tokenized) while 960 "a"s (240 tokens) still fit and are served."""
    calls = []
    st.server.default.tokenizer, tokenizer = tiny_tokenizer(calls), st.server.default.tokenizer
    path, key = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")

    def ask(text, **extra):
        prompt = [{"role": "user", "content": text}] if chat else text
        return call(st, "POST", path, {key: prompt, "max_tokens": 16, "ignore_eos": True, **extra})
    try:
        for text in ("b" * 961, "a" * 961, "\u20ac" * 1_000, "a" * 300_000):
            status, _, reply = ask(text)
            assert status == 400 and "maximum context length is 256 tokens" in reply["error"]["message"], reply
        assert calls == []
        if not chat:  # a batch: the one too long is refused before any is tokenized
            status, _, reply = call(st, "POST", "/v1/completions", {"prompt": ["a", "b" * 961], "max_tokens": 16})
            assert status == 400 and "256" in reply["error"]["message"] and calls == []
        status, _, reply = ask("a" * 960)
        counts = {k: v for k, v in reply.get("usage", {}).items() if k != "prompt_tokens_details"}
        assert status == 200 and counts == {"prompt_tokens": 240, "completion_tokens": 16, "total_tokens": 256}, reply
        assert calls == [960]
    finally:
        st.server.default.tokenizer = tokenizer
    wait_idle(st)


# ---- text that is not Unicode ----

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["x", "\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"}, "stop"),
])
def test_a_lone_surrogate_is_a_400(st, path, body, param):
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no text holds: 400 naming the field, not a 500."""
    raw = json.dumps({**body, "max_tokens": 2}).encode()
    assert b"\\ud800" in raw or b"\\udfff" in raw or b"\\udc00" in raw  # sent as the escape, as a client would
    st.server.default.tokenizer, tokenizer = tiny_tokenizer(), st.server.default.tokenizer
    try:
        s = connect(st)
        s.sendall(head(path, len(raw)) + raw)
        s.settimeout(30)
        reply = http.client.HTTPResponse(s)
        reply.begin()
        error = json.loads(reply.read())["error"]
        s.close()
    finally:
        st.server.default.tokenizer = tokenizer
    assert reply.status == 400 and error["param"] == param and "surrogate" in error["message"], error
    wait_idle(st)


def test_a_lone_surrogate_offline_is_a_value_error(tiny_dir):
    from jaxserve import SamplingParams
    llm = make_llm(tiny_dir)
    llm.tokenizer = tiny_tokenizer()
    for prompt in ("\ud800", ["ok", "x\udfffy"]):
        with pytest.raises(ValueError, match="surrogate"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="surrogate"):
        llm.chat([{"role": "user", "content": "\ud800"}], SamplingParams(max_tokens=2), use_tqdm=False)
    # Refused by a cheap bound too, without tokenizing: at most 4 characters a token, max_model_len 96.
    llm.tokenizer = tiny_tokenizer(calls := [])
    with pytest.raises(ValueError, match="max_model_len is 96"):
        llm.generate("b" * 385, SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls == []
    assert llm.generate("a" * 380, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids == [257] * 95


# ---- headers of errors ----

def test_405_keeps_its_allow_header_and_401_asks_for_a_bearer_token(st):
    status, headers, reply = call(st, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST" and reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"  # the client's mistake, not the server's
    status, headers, reply = call(st, "POST", "/v1/completions", {"prompt": [1]}, key=None)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and reply["error"]["code"] == "invalid_api_key"


def test_a_body_over_1_MiB_is_413_a_client_error(st):
    status, _, reply = call(st, "POST", "/v1/completions", {"prompt": "a" * (1 << 20)})
    error = reply["error"]
    assert (status, error["type"], error["code"]) == (413, "invalid_request_error", "request_too_large"), reply
    assert "1048576" in error["message"]  # the limit the client passed


# ---- everyone at once ----

def test_soak_well_behaved_streams_beside_hostile_clients(tiny_dir):
    """Well-behaved streaming clients (greedy and seeded, retrying on 429) run beside hostile ones: oversized stop
    lists, stop strings at the limit, streams nobody reads, trickled bodies and heads, requests asking for more than
    the batch, bursts past capacity, disconnects mid-prefill. Every well-behaved request gets exactly the tokens it
    gets alone; afterwards nothing is held (capacity, pages), /health is truthful, and the engine is not spinning."""
    import asyncio
    import random

    import aiohttp

    from jaxserve import SamplingParams
    from jaxserve.sampling_params import MAX_STOP, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS
    seed = random.randrange(1 << 30)
    print(f"soak seed {seed}")  # shown when the test fails
    rng = random.Random(seed)
    llm = make_llm(tiny_dir, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, warmup=True)
    polite = []
    for i in range(24):
        body = {"prompt": [rng.randrange(1, 300) for _ in range(rng.randint(1, 40))], "max_tokens": rng.randint(1, 12),
                "ignore_eos": True, "logprobs": 0, "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1 << 20)}
        params = SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True, temperature=body["temperature"],
                                seed=body["seed"])
        # Greedy and seeded sampling are batch-independent: what the request gets alone is what it must get here.
        alone = llm.generate({"prompt_token_ids": body["prompt"]}, params, use_tqdm=False)[0].outputs[0].token_ids
        polite.append((body, alone))
    st = ServerThread(llm, NAME, api_key=KEY, max_queued_requests=8, stream_write_timeout_s=LIMIT,
                      header_timeout_s=LIMIT, body_timeout_s=LIMIT)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def well_behaved(session, body):
        """The tokens streamed for body, retrying 429s (as the OpenAI clients do) for up to a minute."""
        deadline = time.monotonic() + 60
        while True:
            async with session.post(st.url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
                if r.status == 429 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1 + rng.random() * 0.2)
                    continue
                assert r.status == 200, (r.status, await r.text())
                tokens, done = [], False
                async for line in r.content:
                    if line.strip() == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        tokens += [int(t) for t in chunk["choices"][0]["logprobs"]["tokens"]]
                assert done
                return tokens

    async def status_of(session, body):
        async with session.post(st.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status

    def never_reads():
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "n": 4, "ignore_eos": True, "stream": True})
        s = connect(st, rcvbuf=4096)
        s.sendall(head("/v1/completions", len(body)) + body.encode())
        time.sleep(8 * LIMIT)  # holds the connection open, reading nothing
        s.close()

    def trickles_body():
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
        s = connect(st)
        s.sendall(head("/v1/completions", len(body)) + body[:3])
        time.sleep(3 * LIMIT)
        s.close()

    def trickles_head():
        s = connect(st)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        time.sleep(3 * LIMIT)
        s.close()

    def leaves_mid_prefill():
        body = json.dumps({"prompt": list(range(1, 201)), "max_tokens": 20, "stream": True}).encode()
        s = connect(st)
        s.sendall(head("/v1/completions", len(body)) + body)
        time.sleep(0.05)
        s.close()

    async def hostile(session):
        statuses = await asyncio.gather(
            status_of(session, {"prompt": [1, 2], "min_tokens": 1,
                                "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}),
            status_of(session, {"prompt": [1, 2], "stop": ["x"] * (MAX_STOP + 1)}),
            status_of(session, {"prompt": [1, 2], "stop": ["x" * (MAX_STOP_LENGTH + 1)]}),
            status_of(session, {"prompt": [[1, 2]] * 8, "n": 2}),  # more than one request may ask for
            *[status_of(session, {"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True, "n": 2})
              for _ in range(12)],  # a burst past capacity
        )
        assert statuses[:4] == [400] * 4, statuses
        assert set(statuses[4:]) <= {200, 429}, statuses
        at_limit = {"prompt": [1, 2], "max_tokens": 8, "stop": ["y" * MAX_STOP_LENGTH] * MAX_STOP,
                    "min_tokens": 1, "stop_token_ids": list(range(300, 300 + MAX_STOP_TOKEN_IDS))}
        for _ in range(20):  # at the limits: served (after the burst's 429s)
            if await status_of(session, at_limit) == 200:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("a request at the stop limits was never served")

    async def soak():
        async with aiohttp.ClientSession() as session:
            sem = asyncio.Semaphore(6)

            async def limited(body):
                async with sem:
                    return await well_behaved(session, body)
            rude = [asyncio.to_thread(f) for f in (never_reads, trickles_body, trickles_head, leaves_mid_prefill,
                                                   never_reads)]
            return (await asyncio.gather(*[limited(body) for body, _ in polite], hostile(session), *rude))[:len(polite)]

    try:
        got = asyncio.run(soak())
        for (body, alone), tokens in zip(polite, got):
            assert tokens == alone, body
        wait_idle(st)
        assert st.server.in_flight == 0
        assert call(st, "GET", "/health")[0] == 200
        steps = st.engine.stats().steps
        time.sleep(0.5)
        assert st.engine.stats().steps == steps  # idle means idle: the engine thread waits, it does not spin
    finally:
        st.stop()


def test_health_turns_503_when_the_engine_stops_making_progress():
    """An engine whose every step fails stops after a few in a row; /health then says 503 and requests get 503."""
    from jaxserve.engine.async_engine import MAX_FAILED_STEPS

    from fake_runner import fake_llm
    llm = fake_llm()
    llm.runner.fail("dispatch", times=-1)
    st = ServerThread(llm, "tiny", api_key=KEY)
    try:
        assert call(st, "GET", "/health")[0] == 200
        statuses = [call(st, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0]
                    for _ in range(MAX_FAILED_STEPS)]
        assert statuses[0] == 500 and statuses[-1] == 503, statuses
        assert call(st, "GET", "/health")[0] == 503
        assert call(st, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 503
    finally:
        st.stop()
