"""`jaxserve serve`: an OpenAI-compatible HTTP server (aiohttp) over an AsyncEngine.

/v1/completions and /v1/chat/completions (streamed as server-sent events or whole), /v1/models, /health and
/metrics (Prometheus). Every error is an OpenAI-style body with a 4xx/5xx status; a bad request never reaches
the engine. A client that goes away aborts its request (its pages are freed before the next step). When more
sequences are admitted than the engine runs plus `max_queued_requests`, the answer is 429 with Retry-After. On
SIGTERM the server stops accepting, lets running requests finish for a grace period, aborts the rest, exits 0.

One client must not hurt another: a request asks for at most `max_request_sequences` (n x prompts); admission is
decided before any costly work, a prompt certainly too long for the context (by its length in characters, see
Tokenizer.max_chars_per_token) is refused before it is tokenized, and tokenizing runs off the event loop on each
model's own `tokenizer_threads` (requests past them wait for that model's threads only, as many as it admits); a
request head, a body, and each write of a stream have a time limit, past which the connection is closed (408 for a
body).

Several models: `Server({name: engine, ...})` serves each engine under its name; a request's `model` field picks
the engine (none: the first), an unknown one is a 404 (code model_not_found, as OpenAI's). Each engine has its own
admission capacity and metrics series (label model_name); /v1/models lists them all; /health is 200 only while every
engine is alive.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import signal
import socket
import struct
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jaxserve.async_engine import AsyncEngine, EngineDeadError
from jaxserve.metrics import ModelMetrics, ServerMetrics
from jaxserve.openai_api import (ApiError, chat_logprobs, completion_body, completion_logprobs, context_length_error,
                                 new_id, parse_chat, parse_completion, render_chat, usage, wants_usage_in_stream)

logger = logging.getLogger("jaxserve")


class _Model:
    """One served engine and what the server keeps for it: its name, capacity, admitted sequences and metrics."""

    def __init__(self, name: str, engine: AsyncEngine, metrics: ModelMetrics, max_queued_requests: int,
                 max_request_sequences: int | None, tokenizer_threads: int):
        self.name, self.engine, self.metrics = name, engine, metrics
        self.tokenizer = engine.llm.tokenizer
        # Sequences (n per request) admitted and not finished: bounded, so a burst gets 429s, not an endless queue.
        max_num_seqs = engine.llm.engine_config.max_num_seqs
        self.capacity = max_num_seqs + max_queued_requests
        # Per request, so one request cannot take the whole capacity and leave every other client a 429.
        self.max_request_sequences = min(max_num_seqs if max_request_sequences is None else max_request_sequences,
                                         self.capacity)
        self.in_flight = 0
        # Its own threads, so that another model's long prompts cannot keep this one's requests from being tokenized.
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(tokenizer_threads, f"tokenize-{name}")


class Server:
    """Server(engine, model_name, ...) serves one engine; Server({model_name: engine, ...}, ...) several, the first
    being the default for requests that name no model. The other arguments apply to each engine (tokenizer_threads:
    the threads each model tokenizes and renders chat templates on)."""

    def __init__(self, engine: AsyncEngine | dict[str, AsyncEngine], model_name: str | None = None, *,
                 api_key: str | None = None, max_queued_requests: int = 256, max_request_sequences: int | None = None,
                 stream_write_timeout_s: float = 30.0, header_timeout_s: float = 10.0, body_timeout_s: float = 30.0,
                 tokenizer_threads: int = 2):
        if isinstance(engine, dict):
            if model_name is not None:
                raise TypeError("with several engines ({name: engine}) the names are the dict's keys: no model_name")
            engines = engine
        else:
            if model_name is None:
                raise TypeError("Server(engine, model_name): a single engine needs its model name")
            engines = {model_name: engine}
        if not engines or not all(isinstance(name, str) and name for name in engines):
            raise ValueError("a server needs at least one engine, each under a non-empty name")
        self._api_key = api_key.encode() if api_key else None
        self.metrics = ServerMetrics()
        self.models = {name: _Model(name, e, self.metrics.add_model(name, e.stats), max_queued_requests,
                                    max_request_sequences, tokenizer_threads) for name, e in engines.items()}
        self.default = next(iter(self.models.values()))
        self.stream_write_timeout_s = stream_write_timeout_s
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.draining = False

    # The default (first) model's, as a single-engine server has always had them.
    @property
    def engine(self) -> AsyncEngine:
        return self.default.engine

    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def tokenizer(self):
        return self.default.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.default.tokenizer = tokenizer

    @property
    def capacity(self) -> int:
        return self.default.capacity

    @property
    def max_request_sequences(self) -> int:
        return self.default.max_request_sequences

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not finished, over every model."""
        return sum(m.in_flight for m in self.models.values())

    def engines(self) -> list[AsyncEngine]:
        return [m.engine for m in self.models.values()]

    def app(self) -> web.Application:
        # aiohttp closes a connection whose next request head is not complete within keepalive_timeout of its
        # opening or of the previous response (idle keep-alive connections alike): that is the header timeout.
        app = web.Application(middlewares=[self._errors, self._auth],
                              handler_args={"keepalive_timeout": self.header_timeout_s})
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    # ---- middleware ----

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return self._error_response(e)
        except web.HTTPException as e:  # aiohttp's own (unknown route, wrong method, body too large)
            if e.status < 400:
                raise
            # Its headers stay (Allow on a 405); its body is replaced.
            headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
            return self._error_response(ApiError(e.status, e.reason or "error"), headers)
        except Exception:  # noqa: BLE001 - a bug answers 500 and the server goes on
            logger.exception("request %s %s failed", request.method, request.path)
            return self._error_response(ApiError(500, "internal server error"))

    @staticmethod
    def _error_response(e: ApiError, headers: dict | None = None) -> web.Response:
        headers = dict(headers or {})
        if e.status in (429, 503):
            headers["Retry-After"] = "1"
        if e.status == 401:
            headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: says which credentials were expected
        return web.json_response(e.body(), status=e.status, headers=headers)

    @web.middleware
    async def _auth(self, request, handler):
        if self._api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            # surrogateescape: aiohttp decodes non-UTF-8 header bytes that way; they must compare, not raise.
            token = given[len("Bearer "):].encode("utf-8", "surrogateescape") if given.startswith("Bearer ") else b""
            if not hmac.compare_digest(token, self._api_key):  # constant time
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        return await handler(request)

    # ---- plain endpoints ----

    async def health(self, request):
        """200 while every engine serves; "degraded" (still 200: requests are served) names the models with stopped
        data-parallel replicas."""
        alive = all(m.engine.alive() for m in self.models.values()) and not self.draining
        if not alive:
            return web.json_response({"status": "unavailable"}, status=503)
        snapshots = {name: m.engine.stats() for name, m in self.models.items()}
        stopped = {name: s.num_replicas - s.num_replicas_healthy for name, s in snapshots.items()
                   if s.num_replicas_healthy < s.num_replicas}
        if stopped:
            return web.json_response({"status": "degraded", "stopped_replicas": stopped})
        return web.json_response({"status": "ok"})

    async def prometheus(self, request):
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request):
        created = int(time.time())
        return web.json_response({"object": "list", "data": [{
            "id": m.name, "object": "model", "created": created, "owned_by": "jaxserve",
            "max_model_len": m.engine.llm.max_model_len} for m in self.models.values()]})

    # ---- generation ----

    async def completions(self, request):
        body = await self._body(request)
        m = self._model(body)
        prompts, params = parse_completion(body)
        for p in prompts:
            if isinstance(p, str):
                self._fits_by_length(m, p, params)
        seqs = params.n * len(prompts)
        with self._admitted(m, seqs):
            # Off the event loop: a 1 MiB prompt takes a while to tokenize, and everyone else must still be served.
            prompts = await self._off_loop(m, seqs, lambda: [self._tokenized(m, p, params) for p in prompts])
            return await self._generate(m, request, body, prompts, params, chat=False)

    async def chat_completions(self, request):
        body = await self._body(request)
        m = self._model(body)
        if m.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids")
        messages, params = parse_chat(body)
        with self._admitted(m, params.n):
            # Off the event loop too: the template renders the conversation, then it is refused by its length or
            # tokenized.
            prompt = await self._off_loop(m, params.n, lambda: self._tokenized(
                m, render_chat(messages, m.tokenizer), params, add_special_tokens=False))
            return await self._generate(m, request, body, [prompt], params, chat=True)

    async def _body(self, request) -> dict:
        try:
            # A body trickled in (or never sent) would hold its connection and handler forever.
            async with asyncio.timeout(self.body_timeout_s):
                body = await request.json()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           code="request_timeout", type="invalid_request_error") from None
        except (ValueError, LookupError, RecursionError) as e:  # bad JSON, bad UTF-8, bad charset, too deep
            raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _model(self, body: dict) -> _Model:
        """The engine the request's `model` names (none: the default one)."""
        name = body.get("model")
        if name is None:
            return self.default
        if not isinstance(name, str):
            raise ApiError(400, f"model must be a string, got {type(name).__name__}", "model")
        m = self.models.get(name)
        if m is None:  # OpenAI's answer: 404, invalid_request_error, code model_not_found
            served = ", ".join(f"`{n}`" for n in self.models)
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}", "model",
                           "model_not_found")
        return m

    def _tokenized(self, m: _Model, prompt, params, add_special_tokens: bool = True) -> dict:
        """{"prompt_token_ids", "prompt"}, refused when prompt + max_tokens cannot fit max_model_len (as vLLM)."""
        if isinstance(prompt, str):
            if m.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as an array of token ids", "prompt")
            self._fits_by_length(m, prompt, params)
            try:
                ids = m.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except ValueError as e:  # text no tokenizer takes (a lone surrogate from a chat template's other fields)
                raise ApiError(400, str(e)) from None
            prompt = {"prompt_token_ids": ids, "prompt": prompt}
        n, limit = len(prompt["prompt_token_ids"]), m.engine.llm.max_model_len
        if n + (params.max_tokens or 1) > limit:
            raise context_length_error(limit, n, params.max_tokens)
        return prompt

    @staticmethod
    def _fits_by_length(m: _Model, text: str, params) -> None:
        """Refuses a text certainly too long from its length alone: tokenizing 1 MB takes over a second."""
        min_tokens = getattr(m.tokenizer, "min_tokens", None)  # a stand-in tokenizer (tests) may state no bound
        if min_tokens is None:
            return
        floor, limit = min_tokens(text), m.engine.llm.max_model_len
        if floor + (params.max_tokens or 1) > limit:
            raise context_length_error(limit, floor, params.max_tokens, at_least=True)

    async def _off_loop(self, m: _Model, seqs: int, fn, *args):
        """fn(*args) on one of the model's tokenizing threads, for work too heavy for the event loop. Runs
        within _admitted: if the client leaves meanwhile, its `seqs` of capacity stay taken until the thread is done,
        so clients that send long prompts and leave cannot pile work up beyond the capacity."""
        future = asyncio.get_running_loop().run_in_executor(m.tokenizing, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            m.in_flight += seqs  # _admitted gives it back as the handler unwinds; the thread still works
            future.add_done_callback(lambda _: setattr(m, "in_flight", m.in_flight - seqs))
            raise

    @contextlib.contextmanager
    def _admitted(self, m: _Model, seqs: int):
        """Holds `seqs` of the model's capacity for the block, or refuses the request: checked before anything
        costly."""
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if seqs > m.max_request_sequences:
            raise ApiError(400, f"{seqs} sequences (n x prompts) are more than one request may ask for on this "
                                f"server ({m.max_request_sequences})", "n")
        if m.in_flight + seqs > m.capacity:
            raise ApiError(429, "too many requests are queued; retry later", code="rate_limit_exceeded")
        m.in_flight += seqs
        try:
            yield
        finally:
            m.in_flight -= seqs

    async def _generate(self, m: _Model, request, body, prompts: list, params, chat: bool):
        """prompts: tokenized, one engine request each (a completions batch); choice k * n + i is prompt k's i-th
        sample. Runs within _admitted."""
        stream = body.get("stream") is True
        include_usage = wants_usage_in_stream(body)
        run, admitted = _Run(self, m, body, params, chat, len(prompts)), []
        try:
            streams = []
            for k, prompt in enumerate(prompts):
                try:
                    streams.append(await m.engine.add_request(prompt, params, f"{run.id}-{k}"))
                    admitted.append(f"{run.id}-{k}")
                except (ValueError, TypeError) as e:  # bad token ids, a request the cache can never hold, ...
                    raise ApiError(400, str(e)) from None
                except EngineDeadError as e:
                    raise ApiError(503, str(e)) from None
            async with contextlib.aclosing(_merged(streams)) as outputs:
                return await (run.stream(request, outputs, include_usage) if stream else run.whole(outputs))
        finally:
            # However it ended (a client gone, a cancelled handler, an error): a no-op for a finished request.
            for request_id in admitted:
                m.engine.abort(request_id)
            if admitted:
                for reason in run.finish:
                    if reason is None:
                        m.metrics.finished("abort")


async def _merged(streams):
    """(k, output) from several requests' output iterators as they come; each is closed (= aborted if unfinished)
    when this is."""
    async with contextlib.AsyncExitStack() as stack:
        for s in streams:
            await stack.enter_async_context(contextlib.aclosing(s))
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k, s):
            try:
                async for out in s:
                    queue.put_nowait((k, out))
                queue.put_nowait((k, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader
                queue.put_nowait((k, e))

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                k, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield k, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Run:
    """One request's outputs as they come: per choice its text, tokens and timing, and the bodies built from them."""

    def __init__(self, server: Server, model: _Model, body: dict, params, chat: bool, num_prompts: int = 1):
        self.server, self.model, self.params, self.chat = server, model, params, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.arrival = time.monotonic()
        self.first_token_seen = False
        self.top = body.get("top_logprobs") or 0
        self.prompt_tokens = [0] * num_prompts
        choices = params.n * num_prompts
        self.text = [""] * choices
        self.text_offset = [0] * choices  # completions logprobs: where the next token's text starts
        self.tokens = [0] * choices
        self.last_token_at = [None] * choices
        self.finish = [None] * choices
        self.logprobs = [[] for _ in range(choices)]

    def _token_text(self, token_id: int) -> str:
        tok = self.model.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    def _logprobs(self, out, offset: int):
        if self.chat:
            tok = self.model.tokenizer
            return chat_logprobs(out, self._token_text, self.top, tok.token_bytes if tok is not None else None)
        return completion_logprobs(out, self._token_text, offset)

    async def _each(self, outputs):
        """Yields (choice index, CompletionOutput delta) for each new piece, after recording it (metrics too)."""
        metrics = self.model.metrics
        try:
            async for k, out in outputs:
                now = time.monotonic()
                self.prompt_tokens[k] = len(out.prompt_token_ids)
                if not self.first_token_seen and any(c.token_ids for c in out.outputs):
                    # When it happens (as vLLM), so a request aborted later still counts; from the server's receipt.
                    self.first_token_seen = True
                    metrics.ttft.observe(now - self.arrival)
                for c in out.outputs:
                    i = k * self.params.n + c.index
                    if c.token_ids and self.last_token_at[i] is not None:
                        metrics.itl.observe(now - self.last_token_at[i])
                    if c.token_ids:
                        self.last_token_at[i] = now
                    self.tokens[i] += len(c.token_ids)
                    if c.finish_reason is not None:
                        self.finish[i] = c.finish_reason
                        metrics.finished(c.finish_reason)
                    yield i, c
                if out.finished and out.metrics is not None:
                    metrics.observe_request(out.metrics)
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed engine step fails this request only
            raise ApiError(500, f"generation failed: {type(e).__name__}: {e}") from None

    def _usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(self.tokens))

    def _choice(self, i: int, c) -> dict:
        """The chunk (stream) entry of choice i for the delta c."""
        lp = self._logprobs(c, self.text_offset[i])
        self.text[i] += c.text
        if lp is not None and not self.chat:  # each token's own text, sent or still held back from the stream
            self.text_offset[i] += sum(map(len, lp["tokens"]))
        if self.chat:
            return {"index": i, "delta": {"content": c.text} if c.text else {}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        return {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    async def whole(self, outputs) -> web.Response:
        async for i, c in self._each(outputs):
            lp = self._choice(i, c)["logprobs"]
            if lp is not None:
                self.logprobs[i].append(lp)
        choices = []
        for i in range(len(self.text)):
            lp = _merge_logprobs(self.logprobs[i]) if self.params.logprobs is not None else None
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i]},
                                "logprobs": lp, "finish_reason": self.finish[i]})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": lp, "finish_reason": self.finish[i]})
        return web.json_response(completion_body(self.id, self.model.name, choices, self._usage(),
                                                 self.chat, chunk=False))

    async def stream(self, request, outputs, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        name = self.model.name

        async def write(data: bytes, eof: bool = False) -> None:
            try:
                async with asyncio.timeout(self.server.stream_write_timeout_s):
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

        async def send(body) -> None:
            await write(b"data: " + json.dumps(body).encode() + b"\n\n")

        try:
            try:
                if self.chat:  # the role first, as OpenAI sends it
                    role = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(len(self.text))]
                    await send(completion_body(self.id, name, role, None, True, chunk=True))
                async for i, c in self._each(outputs):
                    await send(completion_body(self.id, name, [self._choice(i, c)], None, self.chat, chunk=True))
                if include_usage:
                    await send(completion_body(self.id, name, [], self._usage(), self.chat, chunk=True))
            except ConnectionError:
                raise  # below: nothing to tell a client that is gone
            except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream, as vLLM's
                if not isinstance(e, ApiError):
                    logger.exception("streaming %s failed", self.id)
                    e = ApiError(500, f"internal server error: {type(e).__name__}")
                await send(e.body())
            await write(b"data: [DONE]\n\n", eof=True)
        except ConnectionError:  # the client is gone: nothing to tell it (the caller aborts the request)
            pass
        return resp


def _merge_logprobs(parts: list[dict]) -> dict | None:
    """Per-delta logprobs objects -> one (lists concatenated)."""
    if not parts:
        return None
    merged = {k: [] for k in parts[0]}
    for part in parts:
        for k, v in part.items():
            merged[k] += v
    return merged


async def serve(server: Server, host: str, port: int, grace_period_s: float = 30.0,
                ready: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM/SIGINT; then stops accepting, gives running requests grace_period_s to finish
    (cancelling the rest aborts them), and shuts the engine down."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.warning("serving %s on http://%s:%d", ", ".join(server.models), host, port)
    if ready is not None:
        ready.set()
    await stop.wait()
    logger.warning("shutting down: finishing %d running sequences (at most %.0f s)", server.in_flight,
                   grace_period_s)
    server.draining = True
    for site in list(runner.sites):
        await site.stop()  # no new connections
    deadline = time.monotonic() + grace_period_s
    while server.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    # What still runs ends now: its streams get an error event and [DONE], its pages go back. Every engine at once.
    await asyncio.gather(*(loop.run_in_executor(None, engine.shutdown, 30.0) for engine in server.engines()))
    for m in server.models.values():
        m.tokenizing.shutdown(wait=False, cancel_futures=True)
    await runner.cleanup()
