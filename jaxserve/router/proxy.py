"""One request through the two pools: its prefill on a prefill server (the first token, and where its KV pages
wait), then its decode on a decode server (which fetches the pages and streams what follows), joined into one
OpenAI answer, whole or streamed.

The request goes out as the client sent it (the servers check it; the router checks nothing twice), with
`kv_transfer_params` added: {"do_remote_decode": true} to the prefill server, which answers whole with the first
token's choice and the transfer's params (none when that token ended the request: its answer is then the client's);
{"do_remote_prefill": true, ...those params} to the decode server, always asked for a stream (an idle stream is a
hung server, whatever the answer's length), without echo and prompt_logprobs (the prompt's part of the answer is the
prefill's). The id is the prefill's, usage adds both sides' completion tokens, logprobs are joined (completions'
text_offset shifted past the first token's text).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
from aiohttp import web

from jaxserve.openai.http import DISCARD_PATH, KV_BYTES_HEADER, KV_SECONDS_HEADER, write_stream
from jaxserve.openai.api import ApiError, usage, wants_usage_in_stream
from jaxserve.router.pool import Backend, Pool
from jaxserve.openai.tool_calls import assemble

logger = logging.getLogger("jaxserve")

_FORWARDED_HEADERS = ("Authorization",)


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
        return _error_body(self.raw, self.status)


class ServerFailure(Exception):
    """A server that could not answer (refused, reset, hung, a 5xx): `kind` for the metrics, `reached` False when
    the request never got to it (then it is safe to send elsewhere, even after the prefill). `down`: the server is
    taken out of its pool until /health says it is back: a refused or reset connection, never a timeout (a busy
    server is slow, not gone: under load every server could time out once and the router would refuse everything
    until the next probe)."""

    def __init__(self, kind: str, message: str, reached: bool = True, status: int = 502):
        super().__init__(message)
        self.kind, self.message, self.reached, self.status = kind, message, reached, status
        self.down = kind in ("connect", "disconnect", "draining")


def _failure(e: BaseException, what: str) -> ServerFailure:
    if isinstance(e, aiohttp.ClientConnectorError):
        return ServerFailure("connect", f"{what} could not be reached: {e.os_error}", reached=False)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ServerFailure("timeout", f"{what} did not answer in time", status=504)
    return ServerFailure("disconnect", f"{what} failed: {type(e).__name__}: {e}")


class PDRequest:
    """One client request: prefill, then decode, then the answer. `router` gives the pools, session, timeouts and
    metrics."""

    def __init__(self, router, request: web.Request, body: dict, chat: bool):
        self.router, self.request, self.body, self.chat = router, request, body, chat
        self.path = request.path
        self.stream = body.get("stream") is True
        self.headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        self.arrival = time.monotonic()
        self.prefilled_on: Backend | None = None  # the prefill server holding the request's KV transfer

    # ---- the prefill ----

    async def prefill(self) -> dict:
        """The prefill's JSON answer; ServerAnswer for a server's error to forward as it is. Retried once on another
        prefill server when one fails (nothing has reached the client yet)."""
        body = dict(self.body, kv_transfer_params={"do_remote_decode": True})
        if self.stream:
            body["stream"] = False  # (any other value goes as sent: the server says what is wrong with it)
        pool, tried, failure = self.router.prefill, (), None
        for _ in range(2):
            backend = pool.pick(tried)
            if backend is None:
                break
            if tried:
                self.router.metrics.retries.labels(pool="prefill").inc()
            tried += (backend,)
            try:
                return await self._post(pool, backend, body)
            except ServerFailure as e:
                failure = e
        if failure is None:
            raise ApiError(503, "no prefill server is healthy")
        raise ApiError(failure.status, f"prefill failed: {failure.message}")

    async def _post(self, pool: Pool, backend: Backend, body: dict) -> dict:
        metrics = self.router.metrics
        metrics.requests.labels(pool=pool.role, server=backend.url).inc()
        timeout = aiohttp.ClientTimeout(total=self.router.prefill_timeout_s, connect=self.router.connect_timeout_s)
        try:
            with pool.using(backend):
                async with self.router.session.post(backend.url + self.path, json=body, headers=self.headers,
                                                    timeout=timeout) as r:
                    raw, status, headers = await r.read(), r.status, r.headers
                    self.prefilled_on = backend
        except (aiohttp.ClientError, TimeoutError) as e:
            failure = _failure(e, f"prefill server {backend.url}")
            metrics.failures.labels(pool=pool.role, server=backend.url, kind=failure.kind).inc()
            if failure.down:
                pool.mark_down(backend, failure.message)
            raise failure from None
        if status >= 500:
            metrics.failures.labels(pool=pool.role, server=backend.url, kind="http_5xx").inc()
            raise ServerFailure("http_5xx", f"prefill server {backend.url} answered {status}: "
                                            f"{_error_message(raw)}", status=status)
        if status != 200:
            raise ServerAnswer(status, raw, headers)
        try:
            return json.loads(raw)
        except ValueError:
            metrics.failures.labels(pool=pool.role, server=backend.url, kind="bad_answer").inc()
            raise ServerFailure("bad_answer", f"prefill server {backend.url} answered no JSON") from None

    # ---- the decode ----

    async def decode_events(self, transfer: dict):
        """The decode stream's chunks (dicts); an error event from the server is yielded as it is, and ends it.
        ServerAnswer for a server's own answer other than 200 (but a 429, full, or a 503, shutting down, tried on one
        more server: its admission refused it before any fetch); ServerFailure when the server cannot be reached
        (tried on one more), fails or hangs."""
        body = {k: v for k, v in self.body.items() if k not in ("echo", "prompt_logprobs")}
        body.update(stream=True, stream_options={"include_usage": True},
                    kv_transfer_params={**transfer, "do_remote_prefill": True})
        router, pool = self.router, self.router.decode
        timeout = aiohttp.ClientTimeout(total=None, connect=router.connect_timeout_s,
                                        sock_read=router.decode_timeout_s)
        try:
            async with contextlib.aclosing(self._decode_events(pool, body, timeout)) as events:
                async for event in events:
                    yield event
        except (ServerAnswer, ServerFailure, asyncio.CancelledError):  # (cancelled: the client left)
            await asyncio.shield(self._discard(transfer))  # (a no-op if it was fetched)
            raise

    async def _decode_events(self, pool: Pool, body: dict, timeout: aiohttp.ClientTimeout):
        router = self.router
        tried: tuple[Backend, ...] = ()
        failure = None
        while True:
            backend = pool.pick(tried)
            if backend is None:
                raise ServerFailure("connect", "no decode server is healthy" if failure is None else
                                    f"decode failed: {failure.message}", reached=False, status=503)
            if tried:
                router.metrics.retries.labels(pool="decode").inc()
            tried += (backend,)
            router.metrics.requests.labels(pool="decode", server=backend.url).inc()
            what = f"decode server {backend.url}"
            try:
                with pool.using(backend):
                    async with router.session.post(backend.url + self.path, json=body, headers=self.headers,
                                                   timeout=timeout) as r:
                        self._observe_transfer(r.headers)
                        if r.status != 200:
                            if r.status >= 500:
                                router.metrics.failures.labels(pool="decode", server=backend.url,
                                                               kind="http_5xx").inc()
                            answer = ServerAnswer(r.status, await r.read(), r.headers)
                            # Full or shutting down (its admission refused it before any fetch): another may
                            # take the pages. One shutting down takes no more requests.
                            if r.status in (429, 503):
                                failure = ServerFailure("full" if r.status == 429 else "draining",
                                                        f"{what} answered {r.status}: {_error_message(answer.raw)}",
                                                        reached=False, status=r.status)
                                if failure.down:
                                    pool.mark_down(backend, failure.message)
                                if len(tried) < 2 and pool.pick(tried) is not None:
                                    continue
                            raise answer
                        async for event in _events(r):
                            yield event
                            if "error" in event:
                                router.metrics.failures.labels(pool="decode", server=backend.url,
                                                               kind="stream_error").inc()
                                return
                        return
            except (aiohttp.ClientError, TimeoutError, _Unfinished) as e:
                failure = _failure(e, what)
                router.metrics.failures.labels(pool="decode", server=backend.url, kind=failure.kind).inc()
                if failure.down:
                    pool.mark_down(backend, failure.message)
                if failure.reached or len(tried) == 2:
                    raise failure from None

    async def _discard(self, transfer: dict) -> None:
        """Tells the prefill server that the transfer will not be fetched, so its pages go now, not after their
        TTL (best effort: the TTL remains)."""
        url = f"{self.prefilled_on.url}{DISCARD_PATH}/{transfer.get('transfer_id')}"
        try:
            async with self.router.session.delete(url, headers=self.headers,
                                                  timeout=aiohttp.ClientTimeout(total=self.router.connect_timeout_s)):
                pass
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("could not discard KV transfer at %s: %s: %s", url, type(e).__name__, e)

    def _observe_transfer(self, headers) -> None:
        try:
            if KV_SECONDS_HEADER in headers:
                self.router.metrics.kv_transfer.observe(float(headers[KV_SECONDS_HEADER]))
            if KV_BYTES_HEADER in headers:
                self.router.metrics.kv_transfer_bytes.inc(int(headers[KV_BYTES_HEADER]))
        except ValueError:
            pass  # a server's malformed report is not the client's problem

    # ---- the answer ----

    async def respond(self) -> web.StreamResponse:
        if not self.router.decode.healthy():  # no prefill that no server could go on with
            raise ApiError(503, "no decode server is healthy")
        try:
            first = await self.prefill()
        except ServerAnswer as e:  # the server's own 4xx, as it sent it
            return e.response()
        self.router.metrics.ttft.observe(time.monotonic() - self.arrival)
        transfer = first.pop("kv_transfer_params", None)
        choices = first.get("choices") or [{}]
        if len(choices) != 1:
            raise ApiError(502, f"the prefill server answered {len(choices)} choices: the router runs one sequence "
                                f"per request")
        if choices[0].get("finish_reason") is None and not transfer:
            raise ApiError(502, "the prefill server handed off no KV (no kv_transfer_params in its answer)")
        try:
            return await (self._stream(first, transfer) if self.stream else self._whole(first, transfer))
        finally:
            self.router.metrics.e2e.observe(time.monotonic() - self.arrival)

    async def _whole(self, first: dict, transfer: dict | None) -> web.Response:
        if transfer is None:  # the first token ended it
            return web.json_response(first)
        choice = first["choices"][0]
        texts, logprobs, deltas, finish, completion_tokens = [], [], [], None, 0
        try:
            async for event in self.decode_events(transfer):
                if "error" in event:  # the decode failed after its start (its status line said 200)
                    unavailable = event["error"].get("type") == "service_unavailable"
                    return web.json_response(event, status=503 if unavailable else 500)
                if event.get("usage"):
                    completion_tokens = event["usage"].get("completion_tokens", 0)
                for c in event.get("choices", []):
                    if self.chat:
                        deltas.append(c.get("delta") or {})
                    else:
                        texts.append(c.get("text") or "")
                    if c.get("logprobs") is not None:
                        logprobs.append(c["logprobs"])
                    finish = c.get("finish_reason") or finish
        except ServerAnswer as e:
            return e.response()
        except ServerFailure as e:
            raise ApiError(e.status, e.message) from None
        joined = self._join_logprobs(choice.get("logprobs"), logprobs)
        if self.chat:
            content, calls = assemble(deltas)
            text = (choice.get("message", {}).get("content") or "") + (content or "")
            message = {"role": "assistant", "content": (text or None) if calls else text}
            if calls:
                message["tool_calls"] = calls
            merged = {**choice, "message": message, "logprobs": joined, "finish_reason": finish}
        else:
            merged = {**choice, "text": choice.get("text", "") + "".join(texts), "logprobs": joined,
                      "finish_reason": finish}
        return web.json_response({**first, "choices": [merged], "usage": self._usage(first, completion_tokens)})

    def _usage(self, first: dict, decoded: int) -> dict:
        u = first.get("usage") or {}
        return usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0) + decoded)

    def _join_logprobs(self, first: dict | None, rest: list[dict]) -> dict | None:
        if first is None:
            return None
        if self.chat:
            return {"content": [*first.get("content", []), *(x for lp in rest for x in lp.get("content") or [])]}
        shift = _text_end(first)
        joined = {k: list(v) for k, v in first.items()}
        for lp in rest:
            for k, v in lp.items():
                joined.setdefault(k, []).extend([o + shift for o in v] if k == "text_offset" else v)
        return joined

    async def _stream(self, first: dict, transfer: dict | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        choice = first["choices"][0]
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": first["id"], "object": kind, "created": first["created"], "model": first["model"]}

        def chunk(choices: list, **extra) -> dict:
            return {**head, "choices": choices, **extra}

        async def send(body: dict) -> None:
            await write_stream(self.request, resp, b"data: " + json.dumps(body).encode() + b"\n\n",
                               self.router.stream_write_timeout_s)

        try:
            # The first token at once, as a server's own stream starts.
            if self.chat:
                await send(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]))
                message = choice.get("message") or {}
                delta = {"content": message["content"]} if message.get("content") else {}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                extra = {"prompt_logprobs": first["prompt_logprobs"]} if "prompt_logprobs" in first else {}
                await send(chunk([{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"),
                                   "finish_reason": choice.get("finish_reason")}], **extra))
            else:
                await send(chunk([{k: v for k, v in choice.items()}]))
            decoded, failed = 0, False
            if transfer is not None:
                shift = _text_end(choice.get("logprobs")) if not self.chat else 0
                try:
                    async for event in self.decode_events(transfer):
                        if "error" in event:
                            await send(event)
                            failed = True
                            break
                        if not event.get("choices"):
                            decoded = (event.get("usage") or {}).get("completion_tokens", 0)
                            continue
                        c = event["choices"][0]
                        if self.chat and "role" in (c.get("delta") or {}):
                            continue  # the role went out with the first token
                        if shift and c.get("logprobs") and "text_offset" in c["logprobs"]:
                            c["logprobs"]["text_offset"] = [o + shift for o in c["logprobs"]["text_offset"]]
                        await send({**event, "id": head["id"]})
                except ServerAnswer as e:
                    await send(e.event())
                    failed = True
                except ServerFailure as e:
                    logger.warning("request %s: %s", head["id"], e.message)
                    await send(ApiError(e.status, f"decode failed after the first token: {e.message}").body())
                    failed = True
            # (the prefill server has checked stream_options by now)
            if wants_usage_in_stream(self.body) and not failed:  # (as a server's stream: an error event, then [DONE])
                await send(chunk([], usage=self._usage(first, decoded)))
            await write_stream(self.request, resp, b"data: [DONE]\n\n", self.router.stream_write_timeout_s, eof=True)
        except ConnectionError:  # the client is gone or stopped reading (dropped): nothing to tell it
            pass
        return resp


class _Unfinished(Exception):
    """A stream that ended without its [DONE]: the server went away mid-answer."""


async def _events(r: aiohttp.ClientResponse):
    """The JSON events of a server-sent-events stream up to [DONE]; _Unfinished if it ends before."""
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
            raise _Unfinished("the stream carried an event that is not JSON") from None
    raise _Unfinished("the stream ended before [DONE]")


def _text_end(lp: dict | None) -> int:
    """Where the text after a completions logprobs object starts (its text_offset frame)."""
    if not lp or not lp.get("tokens"):
        return 0
    return lp["text_offset"][-1] + len(lp["tokens"][-1])


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def _error_body(raw: bytes, status: int) -> dict:
    """A server's error answer as an error event (the status line has gone out): its own body if it is one."""
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
    except ValueError:
        pass
    return ApiError(status, _error_message(raw)).body()
