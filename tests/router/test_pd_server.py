"""Prefill/decode disaggregation across servers: `jaxserve serve --role prefill|decode` and `jaxserve router`.

Two servers behind the router answer as one colocated server does (greedy and seeded tokens, logprobs, usage, whole
and streamed, completions and chat); a server that hangs, resets or dies fails its request cleanly (retried once
before the first token), leaks no pages and no KV transfer, and /health and /metrics say so. Tiny random model
(byte tokenizer), except one check with the official client on the default model."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from jaxserve.openai.kv_transfer_params import router_auth
from jaxserve.server.disaggregated import FETCH_FAILED, PrefillSide
from jaxserve.server.kv_trust import NOT_AUTHENTICATED, KVTrust

from serving import AppThread, RouterThread, ServerThread, free_port, http, metric_samples, token_counts, wait_idle
from tiny import make_llm

TTL_S = 5.0
SECRET = "pd-test-secret-0123456789"  # what --kv-transfer-secret / JAXSERVE_KV_SECRET give the router and servers
TRUST = KVTrust.of(SECRET)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def role_llm(path, role, template):
    return make_llm(path, role=role, chat_template=template, max_model_len=128)


def with_router_auth(body: dict) -> dict:
    """A prefill request as the router sends it: {"do_remote_decode": true} MACed over the body."""
    return dict(body, kv_transfer_params={"do_remote_decode": True,
                                          **router_auth(TRUST.secret, body, time.time())})


@pytest.fixture(scope="module")
def pd(tiny_tokenized_dir, template):
    """A colocated server, a prefill server, a decode server, and a router over the two."""
    both = ServerThread(role_llm(tiny_tokenized_dir, "both", template), "tiny")
    decode = ServerThread(role_llm(tiny_tokenized_dir, "decode", template), "tiny", kv_trust=TRUST)
    # A short TTL: a transfer nobody fetches is dropped within seconds (the fetch comes within milliseconds).
    prefill = ServerThread(role_llm(tiny_tokenized_dir, "prefill", template), "tiny",
                           prefill_side=PrefillSide(ttl_s=TTL_S, trust=TRUST))
    # Long timeouts: a first request compiles its step's program (seconds on a busy machine).
    router = RouterThread([prefill.url], [decode.url], health_interval_s=0.2, prefill_timeout_s=120,
                          decode_timeout_s=120, kv_secret=SECRET)
    yield both, prefill, decode, router
    router.stop()
    for st in (both, prefill, decode):
        st.stop()


def post(url, path, body):
    status, raw = http("POST", url + path, body)
    return status, json.loads(raw)


def events(raw: bytes) -> list:
    """An SSE body's events (dicts), checked to end with [DONE]."""
    parts = [p for p in raw.decode().split("\n\n") if p]
    assert parts[-1] == "data: [DONE]", parts[-1]
    return [json.loads(p[len("data: "):]) for p in parts[:-1]]


def streamed_text(evs, chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for e in evs for c in e.get("choices", []))


def assert_clean(*servers):
    """Every request gone, every page back, no KV transfer left unclaimed."""
    for st in servers:
        wait_idle(st)
        if st.server.prefill_side is not None:
            assert len(st.server.prefill_side.store) == 0


COMPLETIONS = [
    {"prompt": "pages move between servers", "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True},
    {"prompt": "seeded", "max_tokens": 10, "temperature": 1.0, "seed": 11, "echo": True, "ignore_eos": True,
     "prompt_logprobs": 1, "logprobs": 0},
    {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 9, "temperature": 0.8, "top_k": 20, "seed": 3, "stop": ["q"]},
]
CHAT = [
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "logprobs": True,
     "top_logprobs": 2, "ignore_eos": True},
    {"messages": [{"role": "user", "content": "again"}], "max_tokens": 8, "temperature": 1.0, "seed": 5},
]


@pytest.mark.parametrize("path, body", [*(("/v1/completions", b) for b in COMPLETIONS),
                                        *(("/v1/chat/completions", b) for b in CHAT)])
def test_the_router_gives_the_colocated_answer_whole_and_streamed(pd, path, body):
    both, prefill, decode, router = pd
    body = {"model": "tiny", **body}
    chat = "chat" in path
    status, want = post(both.url, path, body)
    assert status == 200
    status, got = post(router.url, path, body)
    assert status == 200, got
    assert got["choices"] == want["choices"] and token_counts(got["usage"]) == token_counts(want["usage"])
    assert got.get("prompt_logprobs") == want.get("prompt_logprobs")
    stream = dict(body, stream=True, stream_options={"include_usage": True})
    status, raw = http("POST", router.url + path, stream)
    assert status == 200
    evs = events(raw)
    assert len({e["id"] for e in evs}) == 1
    text = want["choices"][0]["message"]["content"] if chat else want["choices"][0]["text"]
    assert streamed_text(evs, chat) == text
    assert [c["finish_reason"] for e in evs for c in e["choices"] if c["finish_reason"]] == \
        [want["choices"][0]["finish_reason"]]
    assert token_counts(evs[-1]["usage"]) == token_counts(want["usage"]) and not evs[-1]["choices"]
    if not chat and body.get("logprobs") is not None:  # the streamed logprobs join into the whole ones
        lps = [c["logprobs"] for e in evs for c in e["choices"] if c["logprobs"]]
        joined = {k: [x for lp in lps for x in lp[k]] for k in lps[0]}
        whole = want["choices"][0]["logprobs"]
        assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
        # (approximately: the prompt is now a prefix-cache hit, a different sum order)
        assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-4)
        assert [sorted(t or ()) for t in joined["top_logprobs"]] == [sorted(t or ()) for t in whole["top_logprobs"]]
    assert_clean(prefill, decode)


def test_int8_kv_pages_resharded_to_a_tensor_parallel_decode_server(tiny_tokenized_dir, template):
    """int8 KV pages (values and scales) from a prefill server of two data-parallel replicas, through the wire, into
    a decode server of 2-way tensor parallelism (the pages resharded by KV head): the colocated engine's tokens,
    whole and streamed."""
    args = dict(kv_cache_dtype="int8")
    both = ServerThread(make_llm(tiny_tokenized_dir, **args), "tiny")
    prefill = ServerThread(make_llm(tiny_tokenized_dir, role="prefill", data_parallel_size=2, **args), "tiny",
                           kv_trust=TRUST)
    decode = ServerThread(make_llm(tiny_tokenized_dir, role="decode", tensor_parallel_size=2, **args), "tiny",
                          kv_trust=TRUST)
    router = RouterThread([prefill.url], [decode.url], prefill_timeout_s=120, decode_timeout_s=120, kv_secret=SECRET)
    try:
        for body in ({"prompt": "int8 pages, resharded", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
                     {"prompt": "seeded int8", "max_tokens": 10, "temperature": 1.0, "seed": 2, "ignore_eos": True}):
            want = post(both.url, "/v1/completions", body)[1]["choices"][0]["text"]
            assert post(router.url, "/v1/completions", body)[1]["choices"][0]["text"] == want
            # Again, streamed: a prefix-cache hit on both sides now, which with int8 pages may change the tokens (it
            # does here, on a colocated engine too): the colocated engine's own second answer is the reference.
            stream = dict(body, stream=True)
            want = streamed_text(events(http("POST", both.url + "/v1/completions", stream)[1]), chat=False)
            assert streamed_text(events(http("POST", router.url + "/v1/completions", stream)[1]), chat=False) == want
        assert_clean(prefill, decode)
    finally:
        router.stop()
        for st in (both, prefill, decode):
            st.stop()


def test_a_first_token_that_ends_the_request_never_reaches_a_decode_server(pd):
    both, prefill, decode, router = pd
    before = metric_samples(http("GET", router.url + "/metrics")[1].decode())
    body = {"model": "tiny", "prompt": "one", "max_tokens": 1, "temperature": 0}
    assert post(router.url, "/v1/completions", body)[1]["choices"] == post(both.url, "/v1/completions", body)[1][
        "choices"]
    evs = events(http("POST", router.url + "/v1/completions", dict(body, stream=True))[1])
    assert [c["finish_reason"] for e in evs for c in e["choices"]] == ["length"]
    after = metric_samples(http("GET", router.url + "/metrics")[1].decode())
    key = ("jaxserve_router:requests_total", frozenset({'pool="decode"', f'server="{decode.url}"'}))
    assert after.get(key, 0) == before.get(key, 0)
    assert_clean(prefill, decode)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "temperature": 5}),  # the prefill server's 400, as it is
    ("/v1/completions", {"prompt": "x", "model": "nope"}),  # 404
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}),  # past the context
    ("/v1/chat/completions", {"messages": []}),
])
def test_errors_of_the_servers_are_forwarded_as_they_are(pd, path, body):
    both, _, _, router = pd
    body = {"model": "tiny", **body}
    assert post(router.url, path, body) == post(both.url, path, body)


def test_a_transfer_is_advertised_at_a_reachable_address_and_held_as_a_copy(pd):
    _, prefill, _, _ = pd
    side = prefill.server.prefill_side
    bound, side.kv_server.host = side.kv_server.host, "0.0.0.0"  # as `--host 0.0.0.0` binds it
    try:
        status, answer = post(prefill.url, "/v1/completions", with_router_auth({
            "model": "tiny", "prompt": "wildcard", "max_tokens": 4, "temperature": 0, "ignore_eos": True}))
    finally:
        side.kv_server.host = bound
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    kv = side.store.take(params["transfer_id"])
    assert params["remote_host"] == "127.0.0.1"
    # The pages held are a copy of the prompt's: no view keeping the whole padded export alive (as bytes_held counts).
    assert all(a.base is None for layer in kv for a in layer)
    assert_clean(prefill)


def test_what_disaggregation_does_not_do_is_a_clear_400(pd):
    _, prefill, decode, router = pd
    status, body = post(router.url, "/v1/completions", {"prompt": "x", "n": 2})
    assert status == 400 and "one sequence per request" in body["error"]["message"]
    status, body = post(router.url, "/v1/completions", {"prompt": ["a", "b"]})
    assert status == 400 and "one sequence per request" in body["error"]["message"]
    # The role servers serve the router's requests only.
    for st, side in ((prefill, "do_remote_decode"), (decode, "do_remote_prefill")):
        status, body = post(st.url, "/v1/completions", {"prompt": "x"})
        assert status == 400 and side in body["error"]["message"]
    status, body = post(router.url, "/v1/completions", "not an object")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def prefilled_params(prefill, body: dict) -> dict:
    """A real prefill answer's kv_transfer_params (its pages held), as the router passes them to a decode server."""
    status, answer = post(prefill.url, "/v1/completions", with_router_auth(body))
    assert status == 200, answer
    return dict(answer["kv_transfer_params"], do_remote_prefill=True)


def test_a_failed_kv_fetch_is_a_clean_error(pd):
    """A decode server told to fetch pages that are not there (the prefill server died, or the transfer expired):
    a 502 that says nothing of the peer, and nothing was added."""
    _, prefill, decode, _ = pd
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    params = prefilled_params(prefill, body)
    assert prefill.server.prefill_side.store.discard(params["transfer_id"])  # gone before the fetch
    status, answer = post(decode.url, "/v1/completions", dict(body, kv_transfer_params=params, stream=True))
    assert status == 502 and answer["error"]["message"] == FETCH_FAILED, answer
    assert_clean(prefill, decode)


@pytest.mark.parametrize("prompt", ["tokens differ!", "tokens diffex"])
def test_a_prompt_that_tokenizes_otherwise_on_the_decode_server_is_a_400_before_any_fetch(pd, prompt):
    """Another tokenizer or chat template on the decode server, or a client passing one prompt's pages off as
    another's (issue 48 (b): "France" decoded on Germany's pages): the pages would be for other tokens."""
    _, prefill, decode, _ = pd
    body = {"model": "tiny", "prompt": "tokens differ", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    params = prefilled_params(prefill, body)
    status, answer = post(decode.url, "/v1/completions", dict(body, prompt=prompt, kv_transfer_params=params))
    assert status == 400 and "tokenizes otherwise" in answer["error"]["message"], answer
    assert prefill.server.prefill_side.store.discard(params["transfer_id"])  # never fetched
    assert_clean(prefill, decode)


class Listener:
    """A listening socket that counts the connections made to it (accepted by a thread): proof of none."""

    def __init__(self, http_server: bool):
        import socket
        import threading
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        self.http_server = http_server
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.http_server:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            conn.close()


def forgeries(real: dict, port: int) -> list[dict]:
    """kv_transfer_params a client could send, pointing at port: made up whole (with a MAC of its own), or a real
    answer's with the port changed (and its MAC kept)."""
    return [dict(real, remote_port=port, transfer_id="guessed", mac="f" * 64), dict(real, remote_port=port)]


def test_forged_kv_transfer_params_are_refused_alike_before_any_connection(pd):
    """Issue 48 item 2: a client sending kv_transfer_params straight to a decode server had it connect wherever they
    pointed (a port-scan oracle: a web server's port answered "a 1347703880-byte message", a closed one otherwise).
    Params the prefill server did not write are one 400, the same whatever they name, before any connection; any one
    field changed is refused the same way; the server serves on."""
    _, prefill, decode, router = pd
    body = {"model": "tiny", "prompt": "forged", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    real = prefilled_params(prefill, body)
    web_server, closed = Listener(http_server=True), free_port()
    answers = [post(decode.url, "/v1/completions", dict(body, kv_transfer_params=forged))
               for port in (web_server.port, closed) for forged in forgeries(real, port)]
    assert answers == [(400, {"error": {"message": NOT_AUTHENTICATED, "type": "invalid_request_error",
                                        "param": "kv_transfer_params", "code": None}})] * len(answers)
    for field, value in real.items():  # each field changed alone: refused (or out of range) all the same
        if field not in ("do_remote_prefill", "mac"):
            changed = value + 1 if isinstance(value, int) else value[:-1] + ("1" if value[-1] == "0" else "0")
            status, answer = post(decode.url, "/v1/completions", dict(body, kv_transfer_params=dict(real, **{
                field: changed})))
            message = answer["error"]["message"]
            assert status == 400 and (message == NOT_AUTHENTICATED or f".{field} must be in" in message), answer
    assert web_server.accepted == 0
    web_server.sock.close()
    # The real params still work (nothing was fetched), and the server serves on.
    status, answer = post(decode.url, "/v1/completions", dict(body, kv_transfer_params=real))
    assert status == 200, answer
    assert post(router.url, "/v1/completions", body)[0] == 200
    assert_clean(prefill, decode)


def test_fuzzed_kv_transfer_params_are_4xx_on_both_roles(pd):
    """Random kv_transfer_params (each field missing, mistyped, out of range or plausible; a real answer's with one
    field fuzzed) to either role server: always a 4xx, never a 5xx, and both serve on. So is a MAC that is no tag
    (non-ASCII text made hmac.compare_digest raise TypeError: a 500 on both roles) on the router's params to a
    prefill server and the prefill server's to a decode server."""
    import random
    _, prefill, decode, router = pd
    rng = random.Random(4848)
    body = {"model": "tiny", "prompt": "fuzz", "max_tokens": 2, "temperature": 0}
    real = prefilled_params(prefill, body)
    junk = [None, True, -1, 0, 2**31, 10**30, 1.5, "", "x" * 300, "\udcff", "127.0.0.1", "[::1]", [], {}, "0" * 64,
            "é", "\ud800", "é" * 64]
    for _ in range(120):
        params = {k: v for k, v in real.items() if rng.random() < 0.8}
        for key in rng.sample(sorted(real), rng.randrange(1, 4)):
            params[key] = rng.choice(junk)
        for st in (decode, prefill):
            status, answer = post(st.url, "/v1/completions", dict(body, kv_transfer_params=params))
            assert 400 <= status < 500, (params, answer)
    for mac in ["é", "\ud800", "é" * 64, "\ud800" * 64, "F" * 64, "0" * 63, "0" * 64 + "\n"]:
        routed = with_router_auth(body)["kv_transfer_params"]
        for st, params in ((decode, dict(real, mac=mac)), (prefill, dict(routed, mac=mac))):
            status, answer = post(st.url, "/v1/completions", dict(body, kv_transfer_params=params))
            assert status == 400 and answer["error"]["message"] == NOT_AUTHENTICATED, (params, answer)
    assert prefill.server.prefill_side.store.discard(real["transfer_id"])
    assert post(router.url, "/v1/completions", body)[0] == 200
    assert_clean(prefill, decode)


def test_a_decode_server_without_a_secret_or_off_its_peers_list_refuses_params(pd, tiny_tokenized_dir, template):
    """No secret: no kv_transfer_params served at all. --kv-transfer-peers: a port off the list is a 400 before any
    connection, even with the prefill server's MAC."""
    _, prefill, _, _ = pd
    body = {"model": "tiny", "prompt": "peers", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    params = prefilled_params(prefill, body)
    for trust, message in ((KVTrust(), "no KV transfer secret"),
                           (KVTrust.of(SECRET, "127.0.0.1:1,10.0.0.1"), "not on this decode server's")):
        decode = ServerThread(role_llm(tiny_tokenized_dir, "decode", template), "tiny", kv_trust=trust)
        try:
            status, answer = post(decode.url, "/v1/completions", dict(body, kv_transfer_params=params))
            assert status == 400 and message in answer["error"]["message"], answer
        finally:
            decode.stop()
    assert len(prefill.server.prefill_side.store) == 1  # never fetched
    assert prefill.server.prefill_side.store.discard(params["transfer_id"])


def test_only_the_router_has_a_prefill_server_hold_pages(pd):
    """Issue 48 item 5: a client's own {"do_remote_decode": true} parked pages for the TTL. Without the router's MAC
    over this very body (or with an expired one), a 400 and nothing held."""
    _, prefill, _, _ = pd
    body = {"model": "tiny", "prompt": "parked", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    signed = with_router_auth(body)
    expired = dict(body, kv_transfer_params={"do_remote_decode": True,
                                             **router_auth(TRUST.secret, body, time.time() - 3600)})
    for params in ({"do_remote_decode": True}, signed["kv_transfer_params"]):
        for sent in (dict(body, kv_transfer_params=params), dict(body, prompt="another", kv_transfer_params=params)):
            if sent == signed:
                continue
            status, answer = post(prefill.url, "/v1/completions", sent)
            assert status == 400 and answer["error"]["message"] == NOT_AUTHENTICATED, answer
    status, answer = post(prefill.url, "/v1/completions", expired)
    assert status == 400 and answer["error"]["message"] == NOT_AUTHENTICATED, answer
    assert len(prefill.server.prefill_side.store) == 0
    assert_clean(prefill)


def test_a_first_token_outside_the_vocabulary_is_a_400(pd):
    """Issue 48 item 3: first_token_id 10**9 answered 200, -3 and 2**31 a 500."""
    from jaxserve.openai.kv_transfer_params import RemoteKV
    _, prefill, decode, _ = pd
    body = {"model": "tiny", "prompt": "first token", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    params = prefilled_params(prefill, body)
    try:
        for first in (decode.engine.vocab_size, 10**9, -3, 2**31):
            remote = RemoteKV(**{**{k: v for k, v in params.items() if k != "do_remote_prefill"},
                                 "first_token_id": first}).signed(TRUST.secret)
            status, answer = post(decode.url, "/v1/completions",
                                  dict(body, kv_transfer_params=dict(remote.to_json(), do_remote_prefill=True)))
            assert status == 400 and "first_token_id" in answer["error"]["message"], (first, answer)
    finally:
        assert prefill.server.prefill_side.store.discard(params["transfer_id"])  # never fetched
    assert_clean(prefill, decode)


def test_health_and_metrics(pd):
    _, prefill, decode, router = pd
    status, raw = http("GET", router.url + "/health")
    health = json.loads(raw)
    # Counts only (issue 48 item 16: the role servers' addresses are the router's alone).
    assert status == 200 and health == {"status": "ok", "prefill": {"healthy": 1, "total": 1},
                                        "decode": {"healthy": 1, "total": 1}}
    assert prefill.url not in raw.decode() and decode.url not in raw.decode()
    assert [(b["url"], b["healthy"]) for b in router.router.prefill.state()] == [(prefill.url, True)]
    post(router.url, "/v1/completions", {"prompt": "metrics", "max_tokens": 4, "ignore_eos": True})
    samples = metric_samples(http("GET", router.url + "/metrics")[1].decode())
    assert samples["jaxserve_router:requests_total", frozenset({'pool="prefill"', f'server="{prefill.url}"'})] >= 1
    assert samples["jaxserve_router:requests_total", frozenset({'pool="decode"', f'server="{decode.url}"'})] >= 1
    assert samples["jaxserve_router:kv_transfer_seconds_count", frozenset({""})] >= 1
    assert samples["jaxserve_router:kv_transfer_bytes_total", frozenset({""})] > 0
    assert samples["jaxserve_router:time_to_first_token_seconds_count", frozenset({""})] >= 1
    models = json.loads(http("GET", router.url + "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_the_openai_client_through_the_router(pd):
    from openai import OpenAI
    both, prefill, decode, router = pd
    c, ref = (OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0) for st in (router, both))
    assert [m.id for m in c.models.list().data] == ["tiny"]
    args = dict(model="tiny", prompt="the client", max_tokens=10, temperature=0, logprobs=1)
    r, want = c.completions.create(**args), ref.completions.create(**args)
    assert r.choices[0].text == want.choices[0].text and token_counts(r.usage) == token_counts(want.usage)
    assert r.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
    chunks = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.choices[0].text
    assert token_counts(chunks[-1].usage) == token_counts(want.usage)
    messages = [{"role": "user", "content": "chat with the client"}]
    args = dict(model="tiny", messages=messages, max_tokens=10, temperature=0.9, seed=1, logprobs=True, top_logprobs=1)
    r, want = c.chat.completions.create(**args), ref.chat.completions.create(**args)
    assert r.choices[0].message.content == want.choices[0].message.content
    assert r.choices[0].logprobs == want.choices[0].logprobs and token_counts(r.usage) == token_counts(want.usage)
    chunks = list(c.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.choices[0].message.content
    # A grammar holds on the decode side too (its matcher took the first token).
    args = dict(model="tiny", messages=messages, max_tokens=20, temperature=0,
                extra_body={"structured_outputs": {"regex": "[a-c]{3}x[0-9]{2}"}})
    assert c.chat.completions.create(**args).choices[0].message.content == \
        ref.chat.completions.create(**args).choices[0].message.content
    import openai
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="x", temperature=5)
    assert_clean(prefill, decode)


# ---- faults ----

def stub(mode: str) -> AppThread:
    """A server whose /health says 200 and whose completions hang ("hang"), reset the connection ("reset") or
    answer 429 ("full")."""
    async def health(request):
        return web.json_response({"status": "ok"})

    async def completions(request):
        await request.read()
        if mode == "full":
            return web.json_response({"error": {"message": "too many requests are queued; retry later",
                                                "type": "rate_limit_error", "param": None, "code": None}},
                                     status=429)
        if mode == "draining":
            return web.json_response({"error": {"message": "the server is shutting down",
                                                "type": "service_unavailable", "param": None, "code": None}},
                                     status=503)
        if mode == "reset":
            request.transport.abort()
        await asyncio.sleep(3600)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return AppThread(app)


@pytest.mark.parametrize("mode", ["hang", "reset"])
def test_a_prefill_server_that_hangs_or_resets_is_retried_once_on_another(pd, mode):
    both, prefill, decode, warm = pd
    body = {"model": "tiny", "prompt": "retried", "max_tokens": 6, "temperature": 0}
    for _ in range(2):  # its programs compiled (a prompt, then a prefix-cache hit): the timeout is the stub's
        assert post(warm.url, "/v1/completions", body)[0] == 200
    stub_server = stub(mode)
    # The stub first (ties go to the first); a long health interval, so the probe does not bring it back meanwhile.
    router = RouterThread([stub_server.url, prefill.url], [decode.url], prefill_timeout_s=2.0, health_interval_s=60,
                          kv_secret=SECRET)
    try:
        t0 = time.monotonic()
        status, got = post(router.url, "/v1/completions", body)
        assert status == 200 and got["choices"] == post(both.url, "/v1/completions", body)[1]["choices"]
        assert time.monotonic() - t0 < 10
        samples = metric_samples(http("GET", router.url + "/metrics")[1].decode())
        assert samples["jaxserve_router:retries_total", frozenset({'pool="prefill"'})] == 1
        kind = "timeout" if mode == "hang" else "disconnect"
        assert samples["jaxserve_router:failures_total",
                       frozenset({'pool="prefill"', f'server="{stub_server.url}"', f'kind="{kind}"'})] == 1
        health = json.loads(http("GET", router.url + "/health")[1])
        # A reset takes it out of the pool; a timeout does not (a busy server is not a dead one: /health decides).
        assert [b["healthy"] for b in router.router.prefill.state()] == [mode == "hang", True]
        assert health["status"] == "ok"
        # Once out of the pool, it is not tried again (no retry); a hung one still in it is tried, and retried.
        assert post(router.url, "/v1/completions", body)[0] == 200
        assert metric_samples(http("GET", router.url + "/metrics")[1].decode())[
            "jaxserve_router:retries_total", frozenset({'pool="prefill"'})] == 1 + (mode == "hang")
    finally:
        router.stop()
        stub_server.stop()
    assert_clean(prefill, decode)


@pytest.mark.parametrize("mode", ["full", "draining"])
def test_a_full_or_draining_decode_server_passes_the_request_to_another(pd, mode):
    """A decode server's 429 (full) or 503 (shutting down) comes before it fetches anything: the next decode server
    takes the pages; one shutting down leaves the pool."""
    both, prefill, decode, _ = pd
    full = stub(mode)
    router = RouterThread([prefill.url], [full.url, decode.url], health_interval_s=60, kv_secret=SECRET)
    try:
        body = {"model": "tiny", "prompt": "full", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, got = post(router.url, "/v1/completions", body)
        assert status == 200 and got["choices"] == post(both.url, "/v1/completions", body)[1]["choices"]
        samples = metric_samples(http("GET", router.url + "/metrics")[1].decode())
        assert samples["jaxserve_router:retries_total", frozenset({'pool="decode"'})] == 1
        assert [b["healthy"] for b in router.router.decode.state()] == [mode == "full", True]
    finally:
        router.stop()
        full.stop()
    assert_clean(prefill, decode)


def test_a_decode_that_fails_before_its_fetch_discards_the_transfer_at_once(pd):
    """No decode server takes the request (here: the only one is shutting down): the router tells the prefill
    server, whose pages go now rather than after their TTL."""
    _, prefill, decode, _ = pd
    draining = stub("draining")
    router = RouterThread([prefill.url], [draining.url], health_interval_s=60, kv_secret=SECRET)
    try:
        body = {"model": "tiny", "prompt": "discarded", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, answer = post(router.url, "/v1/completions", body)
        assert status == 503 and "shutting down" in answer["error"]["message"], answer
        assert len(prefill.server.prefill_side.store) == 0
    finally:
        router.stop()
        draining.stop()
    assert_clean(prefill, decode)


def test_a_client_that_leaves_before_the_fetch_has_its_transfer_discarded(pd):
    """The decode server has not fetched (here: it hangs) when the client leaves: the pages go now, not after their
    TTL."""
    _, prefill, decode, _ = pd
    hung = stub("hang")
    router = RouterThread([prefill.url], [hung.url], decode_timeout_s=60, health_interval_s=60, kv_secret=SECRET)
    store = prefill.server.prefill_side.store

    async def leave():
        body = {"model": "tiny", "prompt": "left", "max_tokens": 6, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/completions", json=body) as r:
            async for _ in r.content:  # the first token has come: its transfer waits
                if len(store):
                    return
    try:
        asyncio.run(leave())
        deadline = time.monotonic() + TTL_S / 2
        while len(store):
            assert time.monotonic() < deadline, "the transfer waited for its TTL"
            time.sleep(0.02)
    finally:
        router.stop()
        hung.stop()
    assert_clean(prefill, decode)


def test_a_prefill_server_whose_kv_store_is_full_answers_503(pd, caplog):
    """A 503 through the router, which tells the client no more than that (the reason is in its log)."""
    _, prefill, decode, router = pd
    store = prefill.server.prefill_side.store
    store.max_bytes = 1  # (--kv-transfer-max-bytes 1: no transfer fits)
    try:
        body = {"model": "tiny", "prompt": "no room", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, answer = post(router.url, "/v1/completions", body)
        assert status == 503 and answer["error"]["message"] == "the prefill server failed", answer
        assert "cannot hold the request's KV pages" in caplog.text
    finally:
        store.max_bytes = None
    assert_clean(prefill, decode)


def test_a_decode_server_that_hangs_ends_the_request_with_an_error(pd):
    """The first token is out when the decode server stops answering: the stream ends with an error event (a whole
    answer is a 504) once it has been silent for decode_timeout_s; the prefill server holds no pages, and the
    unclaimed transfers' host copies are discarded."""
    _, prefill, decode, _ = pd
    hung = stub("hang")
    router = RouterThread([prefill.url], [hung.url], decode_timeout_s=1.0, health_interval_s=60, kv_secret=SECRET)
    try:
        body = {"model": "tiny", "prompt": "hung decode", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        evs = events(http("POST", router.url + "/v1/completions", dict(body, stream=True))[1])
        assert evs[0]["choices"][0]["text"] and "did not answer in time" in evs[-1]["error"]["message"]
        assert time.monotonic() - t0 < 10
        # A timeout leaves the server in the pool (/health decides): the next request goes there too.
        status, answer = post(router.url, "/v1/completions", body)
        assert status == 504 and "did not answer in time" in answer["error"]["message"]
    finally:
        router.stop()
        hung.stop()
    wait_idle(prefill)
    store = prefill.server.prefill_side.store
    assert len(store) == 0 and store.bytes_held == 0  # the router discarded what the hung server never fetched


def test_a_client_that_leaves_mid_stream_frees_the_decode_servers_pages(pd):
    _, prefill, decode, router = pd

    async def leave():
        body = {"model": "tiny", "prompt": "leaving", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: ")
                if seen == 3:
                    return  # the connection closes with the session

    asyncio.run(asyncio.wait_for(leave(), 60))
    assert_clean(prefill, decode)


def test_no_healthy_prefill_server_ends_the_request_at_once(pd):
    _, prefill, decode, _ = pd
    stubs = [stub("reset"), stub("reset")]  # (a hung one would stay in the pool: a timeout is no proof of death)
    router = RouterThread([s.url for s in stubs], [decode.url], prefill_timeout_s=0.5, health_interval_s=60,
                          kv_secret=SECRET)
    try:
        status, body = post(router.url, "/v1/completions", {"prompt": "x", "stream": True})
        assert status == 502 and body["error"]["message"] == "the prefill server failed"  # (no address: in the log)
        status, body = post(router.url, "/v1/completions", {"prompt": "x"})  # both are out of the pool now
        assert status == 503 and body["error"]["message"] == "no prefill server is healthy"
        assert http("GET", router.url + "/health")[0] == 503
    finally:
        router.stop()
        for s in stubs:
            s.stop()
    assert_clean(prefill, decode)


def test_killing_the_decode_server_mid_stream_ends_the_request_with_an_error(pd, tiny_tokenized_dir, template):
    """A real decode server (its own process) killed while it streams: the client's stream ends with an error event
    and [DONE], the prefill server holds no pages and no transfer, and /health turns 503."""
    _, prefill, _, _ = pd
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--model", tiny_tokenized_dir,
                             "--served-model-name", "tiny", "--role", "decode", "--port", str(port),
                             "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                             "--block-size", "4", "--no-warmup", "--chat-template", template],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSERVE_KV_SECRET": SECRET})
    decode_url = f"http://127.0.0.1:{port}"
    router = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http("GET", decode_url + "/health")[0] == 200:
                    break
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the decode server did not start"
            time.sleep(0.2)
        router = RouterThread([prefill.url], [decode_url], health_interval_s=0.2, decode_timeout_s=120,
                              kv_secret=SECRET)

        async def stream_and_kill():
            body = {"model": "tiny", "prompt": "killed mid-stream", "max_tokens": 100, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            seen = []
            async with aiohttp.ClientSession() as s, s.post(router.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen.append(line[6:].strip())
                        if len(seen) == 4:  # the first token and some decoded ones
                            proc.send_signal(signal.SIGKILL)
            return seen

        seen = asyncio.run(asyncio.wait_for(stream_and_kill(), 60))
        assert seen[-1] == b"[DONE]"
        error = json.loads(seen[-2])["error"]
        assert error["type"] == "server_error" and "decode failed after the first token" in error["message"]
        assert 4 <= len(seen) < 100
        deadline = time.monotonic() + 10
        while http("GET", router.url + "/health")[0] != 503:
            assert time.monotonic() < deadline, "/health never saw the decode server go"
            time.sleep(0.1)
        health = json.loads(http("GET", router.url + "/health")[1])
        assert health["decode"]["healthy"] == 0 and health["prefill"]["healthy"] == 1
        assert_clean(prefill)
    finally:
        if router is not None:
            router.stop()
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("argv, message", [
    (["router", "--prefill", "ftp://x", "--decode", "localhost:2"], "is not a server URL"),
    (["router", "--prefill", "localhost:1", "--decode", "http://localhost:1/"], "in both pools"),
    (["router", "--prefill", "localhost:1", "localhost:1", "--decode", "localhost:2"], "named twice"),
    (["router", "--prefill", "localhost:1", "--decode", "localhost:2", "--decode-timeout", "0"], "--decode-timeout"),
    (["router", "--prefill", "localhost:1", "--decode", "localhost:2", "--port", "0"], "--port"),
    (["serve", "--role", "decode", "--kv-transfer-port", "9000"], "a prefill server's"),
    (["serve", "--kv-transfer-host", "0.0.0.0"], "a prefill server's"),
    (["serve", "--role", "prefill", "--model", "a", "--model", "b"], "serves one model"),
    (["serve", "--role", "prefill", "--kv-transfer-port", "70000"], "--kv-transfer-port"),
    (["serve", "--role", "decode", "--kv-transfer-max-bytes", "9"], "a prefill server's"),
    (["serve", "--role", "prefill", "--kv-fetch-timeout", "5"], "a decode server's"),
    (["serve", "--role", "decode", "--kv-fetch-timeout", "0"], "--kv-fetch-timeout"),
    (["serve", "--role", "prefill", "--kv-transfer-max-bytes", "0"], "--kv-transfer-max-bytes"),
    (["serve", "--role", "decode", "--host", "0.0.0.0"], "without it a role server serves no kv_transfer_params"),
    (["serve", "--role", "prefill", "--kv-transfer-host", "10.0.0.1"], "needs --kv-transfer-secret"),
    (["serve", "--role", "decode", "--kv-transfer-secret", "short"], "at least 16 characters"),
    (["serve", "--role", "prefill", "--kv-transfer-peers", "h:1"], "a decode server's"),
    (["serve", "--role", "decode", "--kv-transfer-peers", "h:99999"], "--kv-transfer-peers"),
    (["serve", "--kv-transfer-secret", SECRET], "a role server's"),
    (["router", "--prefill", "localhost:1", "--decode", "localhost:2"], "needs --kv-transfer-secret"),
])
def test_flag_errors_are_one_line_before_anything_starts(argv, message, capsys, monkeypatch):
    from jaxserve.cli import main
    monkeypatch.delenv("JAXSERVE_KV_SECRET", raising=False)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_loopback_role_server_without_a_secret_says_it_serves_nothing(tmp_path, capsys, monkeypatch):
    """Without the secret a role server serves no kv_transfer_params (review of issue 48: the message spoke of
    fetches from anywhere); on loopback it starts, and says so (here it then finds no model)."""
    from jaxserve.cli import main
    monkeypatch.delenv("JAXSERVE_KV_SECRET", raising=False)
    assert main(["serve", "--role", "decode", "--model", str(tmp_path / "no-model")]) == 1
    err = capsys.readouterr().err
    assert "without --kv-transfer-secret" in err and "refuses every request, the router's too" in err, err


def test_the_default_model_through_the_router_with_the_openai_client(default_llm):
    """The official client's checks of the plain server (test_server.py, test_openai_clients.py), through the router
    over a prefill and a decode server of the default model: the same answers as the colocated server's."""
    import openai
    import pydantic

    from jaxserve import LLM

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int = pydantic.Field(ge=0, le=150)

    name = "SmolLM2-135M-Instruct"
    both = ServerThread(default_llm, name)
    prefill, decode = (ServerThread(LLM(dtype="float32", role=role, max_model_len=512, max_num_seqs=4,
                                        max_num_batched_tokens=256, warmup=False), name, kv_trust=TRUST)
                       for role in ("prefill", "decode"))
    router = RouterThread([prefill.url], [decode.url], prefill_timeout_s=120, decode_timeout_s=120, kv_secret=SECRET)
    try:
        c, ref = (openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0) for st in (router, both))
        assert [m.id for m in c.models.list().data] == [name]
        prompt = "The capital of France is"
        for args in (dict(max_tokens=12, logprobs=1), dict(max_tokens=12, stop=["\n\nThe answer"])):
            args = dict(model=name, prompt=prompt, temperature=0, **args)
            r, want = c.completions.create(**args), ref.completions.create(**args)
            assert "Paris" in r.choices[0].text and r.choices[0].text == want.choices[0].text
            assert r.choices[0].finish_reason == want.choices[0].finish_reason
            assert token_counts(r.usage) == token_counts(want.usage)
            chunks = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.choices[0].text
            assert token_counts(chunks[-1].usage) == token_counts(want.usage)
        assert r.choices[0].text == " Paris."  # a stop string spanning the hand-off's tokens is never sent in part
        messages = [{"role": "user", "content": "Describe a person as JSON: name, age."}]
        args = dict(model=name, messages=messages, response_format=Person, temperature=0, max_tokens=80)
        r, want = c.chat.completions.parse(**args), ref.chat.completions.parse(**args)
        assert r.choices[0].message.parsed == want.choices[0].message.parsed
        assert token_counts(r.usage) == token_counts(want.usage)
        with c.chat.completions.stream(**args) as stream:
            assert stream.get_final_completion().choices[0].message.parsed == want.choices[0].message.parsed
        args = dict(model=name, messages=messages, temperature=0.8, seed=7, max_tokens=16)
        assert c.chat.completions.create(**args).choices[0].message.content == \
            ref.chat.completions.create(**args).choices[0].message.content
        # Issue 48 item 2, live: forged params straight to the decode server (the prefill's real answer for Germany,
        # pointed at a web server or at a closed port; then sent with France's prompt) are refused with nothing of
        # the peer, no connection made, and the server answers the next request as before.
        germany = {"model": name, "prompt": "The capital of Germany is", "max_tokens": 8, "temperature": 0}
        real = prefilled_params(prefill, germany)
        web_server = Listener(http_server=True)
        for forged in forgeries(real, web_server.port) + forgeries(real, free_port()):
            assert post(decode.url, "/v1/completions", dict(germany, kv_transfer_params=forged)) == \
                (400, {"error": {"message": NOT_AUTHENTICATED, "type": "invalid_request_error",
                                 "param": "kv_transfer_params", "code": None}})
        assert web_server.accepted == 0
        web_server.sock.close()
        france = dict(germany, prompt="The capital of France is", kv_transfer_params=real)
        status, answer = post(decode.url, "/v1/completions", france)
        assert status == 400 and "tokenizes otherwise" in answer["error"]["message"]
        assert prefill.server.prefill_side.store.discard(real["transfer_id"])
        r = c.completions.create(model=name, prompt="The capital of France is", max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].text
        assert_clean(prefill, decode)
    finally:
        router.stop()
        for st in (both, prefill, decode):
            st.stop()
