"""The router's HTTP side: the OpenAI endpoints (each request through `proxy.PDRequest`), /v1/models (a decode
server's), /health (the pools' state), /metrics (the router's own), the background health probe, and
`serve_router` (run until SIGTERM, then let running requests finish for a grace period)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import drain, errors, json_body, run_until_signalled
from jaxserve.openai.kv_transfer_params import check_secret
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.pool import Pool
from jaxserve.router.proxy import PDRequest

logger = logging.getLogger("jaxserve")


class PDRouter:
    """PDRouter(prefill_urls, decode_urls): the OpenAI API over a pool of prefill servers and one of decode servers
    (`jaxserve serve --role prefill|decode`).

    prefill_timeout_s: the most a prefill answer may take (a hung server past it fails the request, or retries
    it); decode_timeout_s: the most a decode stream may stay silent; connect_timeout_s: to open a connection;
    health_interval_s: how often every server's /health is asked (a server a request could not reach is out of
    its pool at once, back when its /health answers 200). kv_secret: the secret the servers share
    (`--kv-transfer-secret`): role servers serve only requests MACed with it."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, prefill_timeout_s: float = 300.0,
                 decode_timeout_s: float = 120.0, connect_timeout_s: float = 5.0, health_interval_s: float = 2.0,
                 body_timeout_s: float = 30.0, stream_write_timeout_s: float = 30.0,
                 kv_secret: str | bytes | None = None):
        self.prefill, self.decode = Pool("prefill", prefill_urls), Pool("decode", decode_urls)
        both = {b.url for b in self.prefill.backends} & {b.url for b in self.decode.backends}
        if both:
            raise ValueError(f"a server has one role: {', '.join(sorted(both))} is in both pools")
        self.prefill_timeout_s, self.decode_timeout_s = prefill_timeout_s, decode_timeout_s
        self.connect_timeout_s, self.health_interval_s = connect_timeout_s, health_interval_s
        self.body_timeout_s, self.stream_write_timeout_s = body_timeout_s, stream_write_timeout_s
        self.kv_secret = check_secret(kv_secret)
        self.metrics = RouterMetrics([self.prefill, self.decode])
        self.session: aiohttp.ClientSession | None = None
        self.in_flight = 0
        self.draining = False

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.cleanup_ctx.append(self._client)
        return app

    async def _client(self, app):
        """The session to the servers and the health probe, for the application's life."""
        # No limit on connections per server: each streamed request holds one for its whole decode.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)
        await self.probe()
        task = asyncio.create_task(self._probe_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.session.close()

    async def probe(self) -> None:
        timeout = min(self.health_interval_s, self.connect_timeout_s) + 1.0
        await asyncio.gather(self.prefill.probe(self.session, timeout), self.decode.probe(self.session, timeout))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.probe()
            except Exception:  # noqa: BLE001 - the probe must outlive any one failure
                logger.exception("health probe failed")

    # ---- endpoints ----

    async def health(self, request):
        """200 while at least one prefill and one decode server are healthy; each pool's healthy and total servers
        either way. Counts only: the role servers' addresses are for the router alone (whoever reaches them can
        load them; their errors are in the log)."""
        ok = bool(self.prefill.healthy()) and bool(self.decode.healthy()) and not self.draining
        pools = {p.role: {"healthy": len(p.healthy()), "total": len(p.backends)} for p in (self.prefill, self.decode)}
        return web.json_response({"status": "ok" if ok else "unavailable", **pools}, status=200 if ok else 503)

    async def prometheus(self, request):
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request):
        """The first healthy decode server's list (the pools serve one model)."""
        headers = {h: request.headers[h] for h in ("Authorization",) if h in request.headers}
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s + 5.0)
        for backend in self.decode.healthy():
            try:
                async with self.session.get(backend.url + "/v1/models", headers=headers, timeout=timeout) as r:
                    return web.Response(body=await r.read(), status=r.status, content_type="application/json")
            except (aiohttp.ClientError, TimeoutError) as e:
                self.decode.mark_down(backend, f"/v1/models: {type(e).__name__}: {e}")
        raise ApiError(503, "no decode server is healthy")

    async def completions(self, request):
        if self.draining:
            raise ApiError(503, "the router is shutting down")
        body = await json_body(request, self.body_timeout_s)
        self.in_flight += 1
        try:
            return await PDRequest(self, request, body, chat=request.path.endswith("/chat/completions")).respond()
        finally:
            self.in_flight -= 1


async def serve_router(router: PDRouter, host: str, port: int, grace_period_s: float = 30.0,
                       ready: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM/SIGINT; then stops accepting and gives running requests grace_period_s to finish."""
    pools = (f"the router (prefill {', '.join(b.url for b in router.prefill.backends)}; decode "
             f"{', '.join(b.url for b in router.decode.backends)})")
    runner = await run_until_signalled(router.app(), host, port, pools, ready)
    router.draining = True
    await drain(runner, lambda: router.in_flight, grace_period_s)
    await runner.cleanup()  # cancels what still runs: its server requests are closed, so the servers abort them
