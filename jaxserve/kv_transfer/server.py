"""Serves a KVStore's transfers over TCP, in the prefill server's event loop: one fetch a connection (the
protocol in protocol.py). What takes time (a device-to-host copy, the checksum, a jax offer) runs in a thread, so
the loop keeps serving HTTP while a 400 MB transfer goes out.

Whoever reaches the port can connect (issue 48: 600 idle connections reserved 1 MiB each), so a connection costs
little and not for long, in two stages. Before its request is authenticated, a connection holds one of max_pending
cheap slots (512: a socket and at most MAX_REQUEST_BYTES) for at most auth_timeout_s (1 s); past max_pending,
connections wait in the kernel's backlog, nothing reserved for them here. Only a request that passes (with a secret:
MACed with it, auth.fetch_auth) takes one of max_connections serving slots (64: pages encoded, offered and sent),
so idle or junk connections never stand between a decode server and its pages: they would have to hold all
max_pending slots, each re-opened every second, to delay a fetch, and never reach the serving ones."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from jaxserve.kv_transfer.auth import fetch_verified
from jaxserve.kv_transfer.codec import encoded_parts
from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.jax_transfer import JaxTransferEndpoint
from jaxserve.kv_transfer.layout import flatten_pages
from jaxserve.kv_transfer.protocol import MAX_REQUEST_BYTES, frame, read_message, send_all
from jaxserve.kv_transfer.store import KVStore

logger = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 1.0  # a connection that has not sent its request in this long is dropped (a client sends it at once)
MAX_PENDING = 512  # connections reading their request at once (each a socket and at most MAX_REQUEST_BYTES)
MAX_CONNECTIONS = 64  # requests served at once (a decode server makes one a transfer, for its fetch's length)
MALFORMED = "a malformed fetch request"  # all a client hears of a request that failed in an unforeseen way
PULL_TIMEOUT_S = 60.0  # an offer on the jax path that the client does not pull in this long is dropped
SEND_TIMEOUT_S = 60.0  # a client that has not read its pages in this long (it stopped reading) is dropped


class KVServer:
    """`await start()` listens on host:port (0: a free port) and returns the port; `await close()` stops it. host is
    also the address clients use. With a JaxTransferEndpoint, a client that asks for the jax path gets it;
    otherwise every fetch goes as bytes. send_timeout_s: a client that has not read all of its pages by then is dropped
    (with its pages: they were taken from the store). secret: only fetch requests MACed with it are served (None:
    any). max_connections: requests served at once; max_pending: connections reading their request at once, each for
    at most auth_timeout_s (see the module's note)."""

    def __init__(self, store: KVStore, host: str = "127.0.0.1", port: int = 0,
                 jax_endpoint: JaxTransferEndpoint | None = None, send_timeout_s: float = SEND_TIMEOUT_S,
                 secret: bytes | None = None, max_connections: int = MAX_CONNECTIONS, max_pending: int = MAX_PENDING,
                 auth_timeout_s: float = AUTH_TIMEOUT_S, clock=time.time):
        if max_connections < 1 or max_pending < 1:
            raise ValueError(f"max_connections and max_pending must be >= 1, got {max_connections}, {max_pending}")
        self.store = store
        self.secret, self._clock = secret, clock
        self.auth_timeout_s = auth_timeout_s
        self._pending_slots = asyncio.Semaphore(max_pending)  # (bound to the loop on first use)
        self._slots = asyncio.Semaphore(max_connections)
        self.pending = self.peak_pending = 0  # connections not yet past their request, now and at most
        self.active = self.peak_active = 0  # requests being served, now and at most
        self.send_timeout_s = send_timeout_s
        self.host = host
        self.port = port
        self.jax_endpoint = jax_endpoint
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self.served = {"bytes": 0, "jax": 0}  # fetches answered with pages, by path
        self.bytes_sent = 0

    async def start(self) -> int:
        self._listener = socket.create_server((self.host, self.port), family=_family(self.host))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept())
        self._spawn(self._expire_periodically())
        return self.port

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._listener is not None:
            self._listener.close()

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._pending_slots.acquire()  # a free slot first: past the cap, connections wait in the backlog
            try:
                sock, address = await loop.sock_accept(self._listener)
            except OSError as e:  # out of file descriptors, say: this connection is lost, not the server
                self._pending_slots.release()
                logger.warning("KV server accept failed: %r", e)
                await asyncio.sleep(0.1)
                continue
            except BaseException:
                self._pending_slots.release()
                raise
            sock.setblocking(False)
            self.pending += 1
            self.peak_pending = max(self.peak_pending, self.pending)
            self._spawn(self._connection(sock, f"{address[0]}:{address[1]}"))

    async def _connection(self, sock: socket.socket, peer: str) -> None:
        """One connection: its request read and checked in a pending slot, then served in a serving slot. An
        authenticated request waits for its serving slot in its pending slot, so the sockets held stay bounded."""
        with sock:
            try:
                request = await self._authenticated(sock, peer)
                if request is not None:
                    await self._slots.acquire()
            finally:
                self.pending -= 1
                self._pending_slots.release()
            if request is None:
                return
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            try:
                await self._serve(sock, peer, request)
            finally:
                self.active -= 1
                self._slots.release()

    async def _authenticated(self, sock: socket.socket, peer: str) -> dict | None:
        """The connection's request if it may be served; None once a refusal is answered (or the client left).
        Anything a request can make go wrong ends here (JSON nested past the recursion limit, say): an exception
        out of a connection's task would be its server's "Task exception was never retrieved"."""
        try:
            request = await asyncio.wait_for(read_message(sock, peer, MAX_REQUEST_BYTES), self.auth_timeout_s)
            if self.secret is not None and not fetch_verified(self.secret, request, self._clock()):
                raise KVTransferError("the fetch request is not authenticated")  # (no word of what is held)
            return request
        except TimeoutError:  # (before OSError: it is one)
            error = "no request in time"
        except KVTransferError as e:
            error = str(e)
        except OSError:
            return None
        except Exception:  # noqa: BLE001 - whatever a stranger's bytes did, this connection ends, not the server
            logger.debug("a malformed fetch request from %s", peer, exc_info=True)
            error = MALFORMED
        with contextlib.suppress(OSError):
            await send_all(sock, frame({"ok": False, "error": error}))
        return None

    async def _expire_periodically(self) -> None:
        while True:
            await asyncio.sleep(min(self.store.ttl_s / 4, 5.0))
            self.store.expire()

    async def _serve(self, sock: socket.socket, peer: str, request: dict) -> None:
        """An authenticated request: its pages taken from the store and sent (or why not)."""
        transfer_id = request.get("transfer_id")
        via = request.get("via", ["bytes"])
        try:
            if not isinstance(transfer_id, str):
                raise KVTransferError(f"a fetch request without a transfer_id: {request!r}")
            if not isinstance(via, list) or not all(isinstance(v, str) for v in via):
                raise KVTransferError(f"a fetch request's via must be a list of path names, got {via!r}")
            kv = self.store.take(transfer_id)
        except KVTransferError as e:
            with contextlib.suppress(OSError):
                await send_all(sock, frame({"ok": False, "error": str(e)}))
            return
        via = "jax" if self.jax_endpoint is not None and "jax" in via else "bytes"
        try:  # the pages' export may have failed on the device: the client hears why
            parts, nbytes = await (self._offer(kv) if via == "jax" else self._encode(kv))
        except Exception as e:  # noqa: BLE001 - any failure of this transfer is this transfer's, not the server's
            logger.exception("KV transfer %r could not be prepared", transfer_id)
            with contextlib.suppress(OSError):
                await send_all(sock, frame({"ok": False, "error": f"the KV pages could not be sent: {e!r}"}))
            return
        try:
            await asyncio.wait_for(send_all(sock, *parts), self.send_timeout_s)
        except (OSError, TimeoutError) as e:  # the client went away or stopped reading: its pages go with it
            logger.warning("KV transfer %r to %s failed: %r", transfer_id, peer, e)
            return
        self.served[via] += 1
        self.bytes_sent += nbytes

    async def _encode(self, kv) -> tuple[list, int]:
        """(what to send, the pages' bytes): the reply, then the pages encoded."""
        parts = await asyncio.to_thread(encoded_parts, kv)
        return [frame({"ok": True, "via": "bytes"}), *parts], sum(p.nbytes for p in parts)

    async def _offer(self, kv) -> tuple[list, int]:
        """(what to send, the pages' bytes): the reply that tells where to pull the offered pages from."""
        kinds, arrays = flatten_pages(kv)
        uuid = await asyncio.to_thread(self.jax_endpoint.offer, arrays, PULL_TIMEOUT_S)
        return [frame({"ok": True, "via": "jax", "address": self.jax_endpoint.address, "uuid": uuid, "layers": kinds,
                       "arrays": [[list(a.shape), str(a.dtype)] for a in arrays]})], sum(a.nbytes for a in arrays)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
