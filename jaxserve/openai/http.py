"""What the OpenAI server (jaxserve.server) and the router over servers (jaxserve.router) share on the HTTP side,
with no engine behind it (the router imports no jax): the error middleware, a request's JSON body, a stream write
that drops a client who stopped reading, serving until a signal and draining, and the disaggregation protocol's
names both sides use."""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import struct
import time

from aiohttp import web

from jaxserve.openai.errors import ApiError

logger = logging.getLogger("jaxserve")

KV_TRANSFER_FIELD = "kv_transfer_params"
# A decode server's report of its KV fetch, in its answer's headers (the router's metrics read them).
KV_SECONDS_HEADER, KV_BYTES_HEADER = "X-KV-Transfer-Seconds", "X-KV-Transfer-Bytes"
DISCARD_PATH = "/v1/kv_transfer"  # DELETE DISCARD_PATH/{transfer_id}: a prefill server drops a transfer


@web.middleware
async def errors(request, handler):
    """Every error as an OpenAI-style body: ApiError's own, aiohttp's (unknown route, wrong method, body too large)
    with their status, a bug as 500 (logged; the server goes on)."""
    try:
        return await handler(request)
    except Exception as e:  # noqa: BLE001 - a bug answers 500 and the server goes on
        error, headers = as_api_error(request, e)
        return error_response(error, headers)


def as_api_error(request, e: Exception) -> tuple[ApiError, dict]:
    """The ApiError an exception a handler raised is answered with, and the headers that go with it (Allow on a
    405); an HTTPException below 400 (a redirect) is re-raised, a bug logged and answered 500."""
    if isinstance(e, ApiError):
        return e, {}
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            raise e
        # Its headers stay (Allow on a 405); its body is replaced.
        headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        if isinstance(e, web.HTTPRequestEntityTooLarge):  # the client's body, past client_max_size: its text says it
            return ApiError(413, f"the request body is too large: {e.text}", code="request_too_large"), headers
        return ApiError(e.status, e.reason or "error"), headers
    logger.exception("request %s %s failed", request.method, request.path)
    return ApiError(500, "internal server error"), {}


def error_response(e: ApiError, headers: dict | None = None, body: dict | None = None) -> web.Response:
    """e answered (body: another API's shape of it; OpenAI's by default)."""
    headers = dict(headers or {})
    if e.status in (429, 503):
        headers["Retry-After"] = "1"
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: says which credentials were expected
    return web.json_response(e.body() if body is None else body, status=e.status, headers=headers)


def api_key_auth(api_key: str | None, paths: tuple[str, ...]):
    """The middleware that asks requests to /v1/ and to `paths` for `api_key` (none: lets all through), presented as
    `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in constant time."""
    key = api_key.encode() if api_key else None

    @web.middleware
    async def auth(request, handler):
        if key is not None and (request.path.startswith("/v1/") or request.path in paths):
            if not any(hmac.compare_digest(given, key) for given in given_api_keys(request.headers)):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                               code="invalid_api_key")
        return await handler(request)
    return auth


def given_api_keys(headers) -> list[bytes]:
    """The API keys a request presents (Authorization: Bearer, x-api-key), as bytes."""
    given = headers.get("Authorization", "")
    # surrogateescape: aiohttp decodes non-UTF-8 header bytes that way; they must compare, not raise.
    keys = [given[len("Bearer "):]] if given.startswith("Bearer ") else []
    if "x-api-key" in headers:
        keys.append(headers["x-api-key"])
    return [k.encode("utf-8", "surrogateescape") for k in keys]


def json_bytes_response(data: bytes, headers: dict | None = None) -> web.Response:
    """A 200 of JSON already encoded (off the event loop: see jaxserve.openai.answer_size.encode_json)."""
    return web.Response(body=data, content_type="application/json", charset="utf-8", headers=headers)


async def json_body(request, timeout_s: float) -> dict:
    """The request's JSON object, or a 400 (408 if it does not arrive within timeout_s)."""
    try:
        # A body trickled in (or never sent) would hold its connection and handler forever.
        async with asyncio.timeout(timeout_s):
            body = await request.json()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout", type="invalid_request_error") from None
    except (ValueError, LookupError, RecursionError) as e:  # bad JSON, bad UTF-8, bad charset, too deep
        raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def write_stream(request: web.Request, resp: web.StreamResponse, data: bytes, timeout_s: float,
                       eof: bool = False) -> None:
    """Writes to a streamed response (and ends it, with eof); ConnectionResetError if the client has not taken it
    within timeout_s."""
    try:
        async with asyncio.timeout(timeout_s):
            await (resp.write_eof(data) if eof else resp.write(data))
    except TimeoutError:
        # A client that stopped reading (its window is zero) would hold its capacity forever: it is dropped
        # with a reset, which also frees what the kernel still queues for it.
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        raise ConnectionResetError("the client stopped reading its stream") from None


async def run_until_signalled(app: web.Application, host: str, port: int, what: str,
                              ready: asyncio.Event | None = None) -> web.AppRunner:
    """Serves app on host:port until SIGTERM/SIGINT; then returns its runner, still serving (see drain)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.warning("serving %s on http://%s:%d", what, host, port)
    if ready is not None:
        ready.set()
    await stop.wait()
    return runner


async def drain(runner: web.AppRunner, in_flight, grace_period_s: float) -> None:
    """Stops accepting connections, then waits until in_flight() is 0 or grace_period_s has passed."""
    for site in list(runner.sites):
        await site.stop()  # no new connections
    deadline = time.monotonic() + grace_period_s
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
