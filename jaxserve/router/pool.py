"""The servers of one role (prefill or decode) as the router sees them: each one's URL, requests in flight and
health; the least-loaded healthy one picked per request, its health probed in the background and marked down at once
when a request cannot reach it (refused, reset, shutting down; a timeout is left to the probes)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import aiohttp
from yarl import URL

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class Backend:
    url: str  # http://host:port, no trailing slash
    in_flight: int = 0  # requests the router has sent it and not seen end
    healthy: bool = True  # its latest /health answered 200 (or no request has failed to reach it since)
    last_error: str | None = None

    def state(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "last_error": self.last_error}


class Pool:
    """The servers of one role. `pick` takes the least-loaded healthy one (ties: the first), skipping those a
    request already failed on."""

    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"the router needs at least one {role} server")
        self.role = role
        self.backends = [Backend(normalize_url(u)) for u in urls]
        if len({b.url for b in self.backends}) != len(self.backends):
            raise ValueError(f"a {role} server is named twice: {', '.join(b.url for b in self.backends)}")

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        candidates = [b for b in self.healthy() if b not in exclude]
        return min(candidates, key=lambda b: b.in_flight) if candidates else None

    @contextlib.contextmanager
    def using(self, backend: Backend):
        """Counts a request in flight on `backend` for the block."""
        backend.in_flight += 1
        try:
            yield backend
        finally:
            backend.in_flight -= 1

    def mark_down(self, backend: Backend, error: str) -> None:
        """A request could not reach it (refused, reset, shutting down): no new request goes there until /health says
        it is back."""
        if backend.healthy:
            logger.warning("%s server %s is down: %s", self.role, backend.url, error)
        backend.healthy, backend.last_error = False, error

    async def probe(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Asks every server's /health at once; 200 is healthy, anything else (or no answer in time) is not."""
        async def one(b: Backend) -> None:
            try:
                async with session.get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    ok, error = r.status == 200, f"/health answered {r.status}"
            except (aiohttp.ClientError, TimeoutError) as e:
                ok, error = False, f"/health: {type(e).__name__}: {e}"
            if ok and not b.healthy:
                logger.warning("%s server %s is back", self.role, b.url)
            if ok:
                b.healthy, b.last_error = True, None
            else:
                self.mark_down(b, error)
        await asyncio.gather(*(one(b) for b in self.backends))

    def state(self) -> list[dict]:
        return [b.state() for b in self.backends]


def normalize_url(url: str) -> str:
    """http://host:port (a bare host:port gets http://); refused if it is not an http(s) URL with a host."""
    if "://" not in url:
        url = "http://" + url
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not a server URL (http://host:port)")
    if parsed.path not in ("", "/"):
        raise ValueError(f"{url!r}: give the server's root (http://host:port), not a path")
    return str(parsed.origin())
