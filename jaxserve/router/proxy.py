"""One request through the two pools: its prefill on a prefill server (the first token, and where its KV pages
wait), then its decode on a decode server (which fetches the pages and streams what follows), joined into one
OpenAI answer, whole or streamed.

The request goes out as the client sent it (the servers check it; the router checks nothing twice), with
`kv_transfer_params` added: {"do_remote_decode": true} to the prefill server, which answers whole with the first
token's choice and the transfer's params (none when that token ended the request: its answer is then the client's);
{"do_remote_prefill": true, ...those params} to the decode server, always asked for a stream (an idle stream is a
hung server, whatever the answer's length), without echo and prompt_logprobs (the prompt's part of the answer is the
prefill's). Both answers are joined into the client's in `joined`; what a server's answer or failure means to the
router is `upstream`'s.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
from aiohttp import web

from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import DISCARD_PATH, KV_BYTES_HEADER, KV_SECONDS_HEADER, KV_TRANSFER_FIELD
from jaxserve.openai.kv_transfer_params import KVTransferParams, KVTransferParamsError, RemoteKV, router_auth
from jaxserve.router.joined import JoinedAnswer
from jaxserve.router.pool import Backend, Pool
from jaxserve.router.upstream import ServerAnswer, ServerFailure, Unfinished, error_message, failure_of, sse_events

logger = logging.getLogger("jaxserve")

_FORWARDED_HEADERS = ("Authorization",)
PREFILL_FAILED = "the prefill server failed"  # (which one, and how, is in the log: see ServerFailure)
NO_DECODE = "no decode server is healthy"


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
        body = dict(self.body)
        if self.stream:
            body["stream"] = False  # (any other value goes as sent: the server says what is wrong with it)
        # The router's MAC over this body: only the router may have a prefill server hold pages for a transfer.
        auth = router_auth(self.router.kv_secret, body, time.time()) if self.router.kv_secret is not None else {}
        body[KV_TRANSFER_FIELD] = {**KVTransferParams(do_remote_decode=True).to_json(), **auth}
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
        logger.warning("prefill failed: %s", failure.message)
        raise ApiError(failure.status, failure.public)

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
            failure = failure_of(e, pool.role, backend.url)
            metrics.failures.labels(pool=pool.role, server=backend.url, kind=failure.kind).inc()
            if failure.down:
                pool.mark_down(backend, failure.message)
            raise failure from None
        if status >= 500:
            metrics.failures.labels(pool=pool.role, server=backend.url, kind="http_5xx").inc()
            raise ServerFailure("http_5xx", f"prefill server {backend.url} answered {status}: {error_message(raw)}",
                                PREFILL_FAILED, status=status)
        if status != 200:
            raise ServerAnswer(status, raw, headers)
        try:
            return json.loads(raw)
        except ValueError:
            metrics.failures.labels(pool=pool.role, server=backend.url, kind="bad_answer").inc()
            raise ServerFailure("bad_answer", f"prefill server {backend.url} answered no JSON", PREFILL_FAILED) \
                from None

    # ---- the decode ----

    async def decode_events(self, transfer: RemoteKV):
        """The decode stream's chunks (dicts); an error event from the server is yielded as it is, and ends it.
        ServerAnswer for a server's own answer other than 200 (but a 429, full, or a 503, shutting down, tried on one
        more server: its admission refused it before any fetch); ServerFailure when the server cannot be reached
        (tried on one more), fails or hangs."""
        body = {k: v for k, v in self.body.items() if k not in ("echo", "prompt_logprobs")}
        body.update(stream=True, stream_options={"include_usage": True},
                    **{KV_TRANSFER_FIELD: KVTransferParams(do_remote_prefill=True, remote=transfer).to_json()})
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
                if failure is None:
                    raise ServerFailure("connect", NO_DECODE, NO_DECODE, reached=False, status=503)
                raise ServerFailure("connect", f"decode failed: {failure.message}",
                                    "no decode server could be reached", reached=False, status=503)
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
                                                        f"{what} answered {r.status}: {error_message(answer.raw)}",
                                                        "the decode server is busy", reached=False,
                                                        status=r.status)
                                if failure.down:
                                    pool.mark_down(backend, failure.message)
                                if len(tried) < 2 and pool.pick(tried) is not None:
                                    continue
                            raise answer
                        async for event in sse_events(r):
                            yield event
                            if "error" in event:
                                router.metrics.failures.labels(pool="decode", server=backend.url,
                                                               kind="stream_error").inc()
                                return
                        return
            except (aiohttp.ClientError, TimeoutError, Unfinished) as e:
                failure = failure_of(e, pool.role, backend.url)
                router.metrics.failures.labels(pool="decode", server=backend.url, kind=failure.kind).inc()
                if failure.down:
                    pool.mark_down(backend, failure.message)
                if failure.reached or len(tried) == 2:
                    raise failure from None

    async def _discard(self, transfer: RemoteKV) -> None:
        """Tells the prefill server that the transfer will not be fetched, so its pages go now, not after their
        TTL (best effort: the TTL remains)."""
        url = f"{self.prefilled_on.url}{DISCARD_PATH}/{transfer.transfer_id}"
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
            raise ApiError(503, NO_DECODE)
        try:
            first = await self.prefill()
        except ServerAnswer as e:  # the server's own 4xx, as it sent it
            return e.response()
        self.router.metrics.ttft.observe(time.monotonic() - self.arrival)
        transfer = self._transfer(first)
        joined = JoinedAnswer(self.request, self.body, self.chat, first,
                              self.decode_events(transfer) if transfer is not None else None,
                              self.router.stream_write_timeout_s)
        try:
            return await (joined.stream() if self.stream else joined.whole())
        finally:
            self.router.metrics.e2e.observe(time.monotonic() - self.arrival)

    @staticmethod
    def _transfer(first: dict) -> RemoteKV | None:
        """Takes the KV transfer out of the prefill's answer: where its pages wait, or None when its first token
        ended the request. A 502 for an answer the router cannot go on with."""
        raw = first.pop(KV_TRANSFER_FIELD, None)
        choices = first.get("choices") or [{}]
        if len(choices) != 1:
            raise ApiError(502, f"the prefill server answered {len(choices)} choices: the router runs one sequence "
                                f"per request")
        if choices[0].get("finish_reason") is None and not raw:
            raise ApiError(502, "the prefill server handed off no KV (no kv_transfer_params in its answer)")
        if raw is None:
            return None
        try:
            return RemoteKV.from_json(raw)
        except KVTransferParamsError as e:
            raise ApiError(502, f"the prefill server handed off KV the router cannot pass on: {e}") from None
