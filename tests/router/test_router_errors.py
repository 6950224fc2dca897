"""What a client hears when the router's servers fail (review of issue 48): which side failed and how, never a
server's address nor the OS's error (those are in the router's log). Stub servers, no model."""
import json
import logging

import pytest
from aiohttp import web

from jaxserve.openai.kv_transfer_params import RemoteKV

from serving import AppThread, RouterThread, http

SECRET = "router-errors-secret-0123456789"


def stub(completions) -> AppThread:
    """A server whose /health says 200 and whose completions are `completions(request)`."""
    async def health(request):
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return AppThread(app)


async def prefill_500(request):
    await request.read()
    return web.json_response({"error": {"message": "engine died at /srv/secret/path", "type": "server_error",
                                        "param": None, "code": None}}, status=500)


async def prefilled(request):
    """A prefill server's answer: the first token, and where its pages wait."""
    await request.read()
    remote = RemoteKV("cmpl-1", "10.1.2.3", 8190, 5, 3, 4, "0" * 64, "0" * 64, 2_000_000_000, "0" * 64)
    return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
                              "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
                              "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
                              "kv_transfer_params": remote.to_json()})


async def reset(request):
    await request.read()
    request.transport.abort()
    return web.Response()


def ask(router: RouterThread, stream: bool = False) -> tuple[int, dict]:
    status, raw = http("POST", router.url + "/v1/completions", {"model": "tiny", "prompt": "abcd", "stream": stream})
    if stream:  # the first token went out: the error is the stream's last event before [DONE]
        events = [json.loads(p[len("data: "):]) for p in raw.decode().split("\n\n") if p and p != "data: [DONE]"]
        return status, events[-1]
    return status, json.loads(raw)


def assert_no_detail(message: str, *servers: AppThread) -> None:
    for s in servers:
        assert str(s.port) not in message and "127.0.0.1" not in message, message
    assert "Errno" not in message and "Error" not in message and "/srv" not in message, message


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve")
    return caplog


def test_a_prefill_server_that_fails_or_cannot_be_reached(log):
    failing, decode = stub(prefill_500), stub(reset)
    router = RouterThread([failing.url], [decode.url], health_interval_s=60, kv_secret=SECRET)
    try:
        status, body = ask(router)
        assert status == 500 and body["error"]["message"] == "the prefill server failed"
        assert_no_detail(body["error"]["message"], failing, decode)
        assert failing.url in log.text and "/srv/secret/path" in log.text  # (the operator's to read)
        failing.stop()  # healthy at the last probe, gone now: refused
        status, body = ask(router)
        assert status == 502 and body["error"]["message"] == "the prefill server could not be reached"
        assert_no_detail(body["error"]["message"], failing, decode)
    finally:
        router.stop()
        decode.stop()


def test_a_decode_server_that_fails_or_cannot_be_reached(log):
    prefill, decode = stub(prefilled), stub(reset)
    router = RouterThread([prefill.url], [decode.url], health_interval_s=60, kv_secret=SECRET)
    try:
        status, body = ask(router)
        assert status == 502 and body["error"]["message"] == "the decode server failed"
        assert_no_detail(body["error"]["message"], prefill, decode)
        up = router.router.decode.backends[0]
        up.healthy = True  # (a reset took it out of its pool; as if /health had brought it back)
        status, event = ask(router, stream=True)
        assert status == 200 and event["error"]["message"] == "decode failed after the first token: the decode " \
                                                              "server failed"
        assert decode.url in log.text
        up.healthy = True
        decode.stop()
        status, body = ask(router)
        assert status == 503 and body["error"]["message"] == "no decode server could be reached"
        assert_no_detail(body["error"]["message"], prefill, decode)
    finally:
        router.stop()
        prefill.stop()
