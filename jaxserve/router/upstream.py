"""What the router makes of a server's answer: the server's own answer to forward (`ServerAnswer`), a server that
could not answer (`ServerFailure`, from the client library's error by `failure_of`), and a server-sent-events stream
read as JSON events up to its [DONE] (`sse_events`; `Unfinished` when it ends before)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from jaxserve.openai.errors import ApiError


class ServerAnswer(Exception):
    """A server's own answer other than 200 (a 4xx, or a 5xx after the prefill): forwarded as it is."""

    def __init__(self, status: int, raw: bytes, headers):
        super().__init__(status)
        self.status, self.raw = status, raw
        self.headers = {h: headers[h] for h in ("Retry-After",) if h in headers}

    def response(self) -> web.Response:
        return web.Response(body=self.raw, status=self.status, content_type="application/json",
                            headers=self.headers)

    def event(self) -> dict:
        """As an error event (the status line has gone out): its own body if it is an error body."""
        return error_body(self.raw, self.status)


class ServerFailure(Exception):
    """A server that could not answer (refused, reset, hung, a 5xx): `kind` for the metrics, `reached` False when
    the request never got to it (then it is safe to send elsewhere, even after the prefill). `down`: the server is
    taken out of its pool until /health says it is back: a refused or reset connection, never a timeout (a busy
    server is slow, not gone: under load every server could time out once and the router would refuse everything
    until the next probe). `message` names the server and why, for the router's log; `public` is all the client
    hears (which side failed, and how): never a server's address nor the OS's error, the network behind the router
    is none of a client's business."""

    def __init__(self, kind: str, message: str, public: str, reached: bool = True, status: int = 502):
        super().__init__(message)
        self.kind, self.message, self.public, self.reached, self.status = kind, message, public, reached, status
        self.down = kind in ("connect", "disconnect", "draining")


class Unfinished(Exception):
    """A stream that ended without its [DONE]: the server went away mid-answer."""


def failure_of(e: BaseException, role: str, url: str) -> ServerFailure:
    """The failure a client error (or a timeout, or an unfinished stream) from the `role` server at `url` makes."""
    what, side = f"{role} server {url}", f"the {role} server"
    if isinstance(e, aiohttp.ClientConnectorError):
        return ServerFailure("connect", f"{what} could not be reached: {e.os_error}", f"{side} could not be reached",
                             reached=False)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ServerFailure("timeout", f"{what} did not answer in time", f"{side} did not answer in time",
                             status=504)
    return ServerFailure("disconnect", f"{what} failed: {type(e).__name__}: {e}", f"{side} failed")


async def sse_events(r: aiohttp.ClientResponse):
    """The JSON events of a server-sent-events stream up to [DONE]; Unfinished if it ends before."""
    async for line in r.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise Unfinished("the stream carried an event that is not JSON") from None
    raise Unfinished("the stream ended before [DONE]")


def error_message(raw: bytes) -> str:
    """An error answer's message: its OpenAI-style body's, else its first bytes."""
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def error_body(raw: bytes, status: int) -> dict:
    """A server's error answer as an error event (the status line has gone out): its own body if it is one."""
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
    except ValueError:
        pass
    return ApiError(status, error_message(raw)).body()
