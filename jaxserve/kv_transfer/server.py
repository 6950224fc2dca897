"""Serves a KVStore's transfers over TCP, in the prefill server's event loop: one fetch a connection (the
protocol in protocol.py). What takes time (a device-to-host copy, the checksum, a jax offer) runs in a thread, so
the loop keeps serving HTTP while a 400 MB transfer goes out."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from jaxserve.kv_transfer.codec import encoded_parts
from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.jax_transfer import JaxTransferEndpoint
from jaxserve.kv_transfer.layout import flatten_pages
from jaxserve.kv_transfer.protocol import frame, read_message
from jaxserve.kv_transfer.store import KVStore

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a connection that sends no request in this long is dropped
PULL_TIMEOUT_S = 60.0  # an offer on the jax path that the client does not pull in this long is dropped


class KVServer:
    """`await start()` binds host:port (0: any free port) and returns the port; `await close()` stops it. With a
    JaxTransferEndpoint, a client that asks for the jax path gets it; otherwise every fetch goes as bytes."""

    def __init__(self, store: KVStore, host: str = "127.0.0.1", port: int = 0,
                 jax_endpoint: JaxTransferEndpoint | None = None):
        self.store = store
        self.host = host
        self.port = port
        self.jax_endpoint = jax_endpoint
        self._server: asyncio.Server | None = None
        self._expiry: asyncio.Task | None = None
        self.served = {"bytes": 0, "jax": 0}  # fetches answered with pages, by path
        self.bytes_sent = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._expiry = asyncio.create_task(self._expire_periodically())
        return self.port

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _expire_periodically(self) -> None:
        while True:
            await asyncio.sleep(min(self.store.ttl_s / 4, 5.0))
            self.store.expire()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        try:
            request = await asyncio.wait_for(read_message(reader, peer), REQUEST_TIMEOUT_S)
            transfer_id = request.get("transfer_id")
            if not isinstance(transfer_id, str):
                raise KVTransferError(f"a fetch request without a transfer_id: {request!r}")
            kv = self.store.take(transfer_id)
        except (KVTransferError, TimeoutError) as e:
            await _reply_and_close(writer, {"ok": False, "error": str(e) or "no request in time"})
            return
        try:
            if self.jax_endpoint is not None and "jax" in (request.get("via") or ()):
                await self._send_by_jax(kv, writer)
            else:
                await self._send_bytes(kv, writer)
        except (ConnectionError, OSError) as e:  # the client went away: its pages go with this coroutine's frame
            logger.warning("KV transfer %r to %s failed: %r", transfer_id, peer, e)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _send_bytes(self, kv, writer: asyncio.StreamWriter) -> None:
        parts = await asyncio.to_thread(encoded_parts, kv)
        writer.write(frame({"ok": True, "via": "bytes"}))
        for part in parts:
            writer.write(part)
            await writer.drain()  # one array's bytes buffered at a time, at most
        self.served["bytes"] += 1
        self.bytes_sent += sum(p.nbytes for p in parts)

    async def _send_by_jax(self, kv, writer: asyncio.StreamWriter) -> None:
        kinds, arrays = flatten_pages(kv)
        uuid = await asyncio.to_thread(self.jax_endpoint.offer, arrays, PULL_TIMEOUT_S)
        writer.write(frame({"ok": True, "via": "jax", "address": self.jax_endpoint.address, "uuid": uuid,
                            "layers": kinds, "arrays": [[list(a.shape), str(a.dtype)] for a in arrays]}))
        await writer.drain()
        self.served["jax"] += 1
        self.bytes_sent += sum(int(a.nbytes) for a in arrays)


async def _reply_and_close(writer: asyncio.StreamWriter, message: dict) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        writer.write(frame(message))
        await writer.drain()
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
