"""A jaxserve server on a free loopback port, its event loop in a background thread, for tests."""
import asyncio
import socket
import threading
import time

import aiohttp
from aiohttp import web

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server import Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppThread:
    """An aiohttp application on a free loopback port, its event loop in a background thread."""

    def __init__(self, app: web.Application):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(app, started), daemon=True)
        self._thread.start()
        started.wait(30)

    def _run(self, app, started):
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


class ServerThread(AppThread):
    def __init__(self, llm, name="test-model", **server_args):
        """llm: one LLM served as `name`, or {name: LLM} for several (.engine is the first, .engines all)."""
        llms = llm if isinstance(llm, dict) else {name: llm}
        self.engines = {n: AsyncEngine(x) for n, x in llms.items()}
        self.engine = next(iter(self.engines.values()))
        self.server = Server(self.engines, **server_args)
        super().__init__(self.server.app())

    def stop(self):
        super().stop()
        for engine in self.engines.values():
            engine.shutdown(30)


class RouterThread(AppThread):
    """A `jaxserve router` (jaxserve.router.PDRouter over the given server URLs)."""

    def __init__(self, prefill: list[str], decode: list[str], **router_args):
        from jaxserve.router import PDRouter
        self.router = PDRouter(prefill, decode, **router_args)
        super().__init__(self.router.app())


def wait_idle(st: ServerThread, timeout=30.0):
    """Until no request is admitted, nothing runs and every page is back (prefix-cache pages count as free)."""
    deadline = time.monotonic() + timeout
    while (st.server.in_flight or st.engine.llm.core.has_unfinished() or st.engine.stats().num_running
           or st.engine.stats().kv_cache_usage):
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.02)
    st.engine.llm.core.assert_idle_and_clean()


async def _request(method, url, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=body) as r:
            return r.status, await r.read()


def http(method, url, body=None) -> tuple[int, bytes]:
    """One request (a JSON body, if given) from a client of its own: (status, body bytes)."""
    return asyncio.run(_request(method, url, body))


def metric_samples(text: str) -> dict:
    """/metrics text -> {(metric, frozenset of 'label="value"'): value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            samples[name, frozenset(labels.rstrip("}").split(","))] = float(value)
    return samples


def token_counts(usage) -> tuple[int, int, int]:
    """A usage's prompt, completion and total tokens (a dict or the openai client's object): what two servers'
    answers to one request share; prompt_tokens_details.cached_tokens is each server's prefix cache's own."""
    if not isinstance(usage, dict):
        usage = usage.model_dump()
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
