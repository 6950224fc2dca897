"""Fetches a transfer's KV pages from a KVServer (the decode server's side of the protocol in protocol.py)."""
from __future__ import annotations

import asyncio
import math
import socket
import time

import numpy as np

from jaxserve.kv_transfer.auth import fetch_auth
from jaxserve.kv_transfer.codec import PREFIX, decode_pages, header_length, read_header
from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.jax_transfer import JaxTransferEndpoint, wait_ready
from jaxserve.kv_transfer.layout import DTYPES, check_shapes, unflatten_pages
from jaxserve.kv_transfer.protocol import frame, read_message, recv_exactly, recv_into, send_all
from jaxserve.kv_transfer.worker import import_executor


async def fetch_pages(host: str, port: int, transfer_id: str, timeout: float = 30.0,
                      jax_endpoint: JaxTransferEndpoint | None = None, max_bytes: int | None = None,
                      secret: bytes | None = None) -> list:
    """The KVPages held under transfer_id by the KVServer at host:port, taken from it (a second fetch fails).
    Without jax_endpoint: numpy arrays, sent as bytes with checksums. With one: the server's choice; jax arrays on
    the endpoint's device if it has a jax transfer server, numpy otherwise. KVTransferError on an unknown or expired
    id, a checksum mismatch, a refused, dropped or silent connection, or no pages within timeout seconds; also for
    pages of more than max_bytes (what the caller's cache can take; None: no limit but memory), refused before
    anything is allocated for them. secret: the one the KVServer was started with (its fetch requests are MACed)."""
    peer = f"KV server {host}:{port}"
    request = {"transfer_id": transfer_id, "via": ["bytes"] if jax_endpoint is None else ["jax", "bytes"],
               **fetch_auth(secret, transfer_id, time.time())}
    try:
        async with asyncio.timeout(timeout):
            return await _fetch(host, port, request, jax_endpoint, peer, timeout, max_bytes)
    except TimeoutError as e:
        raise KVTransferError(f"KV transfer {transfer_id!r} from {peer} timed out after {timeout} s") from e


async def _fetch(host, port, request, jax_endpoint, peer, timeout, max_bytes) -> list:
    loop = asyncio.get_running_loop()
    try:
        address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(address[0], socket.SOCK_STREAM)
    except OSError as e:
        raise KVTransferError(f"cannot connect to {peer}: {e}") from e
    with sock:
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address[4])
        except OSError as e:
            raise KVTransferError(f"cannot connect to {peer}: {e}") from e
        try:
            await send_all(sock, frame(request))
            reply = await read_message(sock, peer)
            if not reply.get("ok"):
                raise KVTransferError(f"{peer}: {reply.get('error', 'the fetch failed')}")
            if reply.get("via") == "jax":
                if jax_endpoint is None:
                    raise KVTransferError(f"{peer} answered by the jax path, which this fetch did not offer")
                return await _pull(jax_endpoint, reply, peer, timeout, max_bytes)
            if reply.get("via") != "bytes":
                raise KVTransferError(f"{peer} answered by an unknown path {reply.get('via')!r}")
            return await _receive_bytes(sock, peer, max_bytes)
        except OSError as e:
            raise KVTransferError(f"{peer} dropped the connection: {e!r}") from e


async def _receive_bytes(sock: socket.socket, peer: str, max_bytes: int | None) -> list:
    prefix = await recv_exactly(sock, PREFIX.size, peer, "the pages' prefix")
    prefix += await recv_exactly(sock, header_length(prefix), peer, "the pages' header")
    payload_bytes = read_header(prefix)["payload_bytes"]
    _check_size(payload_bytes, max_bytes, peer)
    # The buffer the decoded arrays view, received into in place; np.empty, not bytearray: zeroing 400 MB would
    # hold the event loop for 0.1 s
    try:
        data = np.empty(len(prefix) + payload_bytes, np.uint8)
    except (MemoryError, ValueError) as e:  # a size no memory holds (a header's lie, or a real monster)
        raise KVTransferError(f"{peer}: no memory for {payload_bytes} bytes of KV pages: {e}") from e
    data[:len(prefix)] = np.frombuffer(prefix, np.uint8)
    await recv_into(sock, memoryview(data)[len(prefix):], peer, "the pages")
    # The checksum (400 MB: 0.2 s) off the loop and below the engine's priority: see worker.py
    return await loop_run(decode_pages, data)


async def loop_run(fn, *args):
    """fn(*args) on the KV import thread (`worker.import_executor`), awaited."""
    return await asyncio.get_running_loop().run_in_executor(import_executor(), fn, *args)


def _check_size(num_bytes: int, max_bytes: int | None, peer: str) -> None:
    if max_bytes is not None and num_bytes > max_bytes:
        raise KVTransferError(f"{peer} offers {num_bytes} bytes of KV pages, more than the {max_bytes} this fetch "
                              "can take")


async def _pull(jax_endpoint: JaxTransferEndpoint, reply: dict, peer: str, timeout_s: float,
                max_bytes: int | None) -> list:
    try:
        kinds, address, uuid = reply["layers"], str(reply["address"]), int(reply["uuid"])
        specs = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in reply["arrays"]]
        check_shapes(kinds, specs)
        specs = [(shape, DTYPES[dtype]) for shape, dtype in specs]
    except (KeyError, TypeError, ValueError, KVTransferError) as e:
        raise KVTransferError(f"{peer}: a malformed jax transfer reply: {e}") from e
    _check_size(sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs), max_bytes, peer)
    try:
        arrays = await asyncio.to_thread(jax_endpoint.pull, address, uuid, specs, timeout_s)  # allocates the buffers
    except Exception as e:  # noqa: BLE001 - out of memory for what the reply says, a bad address: this fetch fails
        raise KVTransferError(f"{peer}: the jax transfer could not start: {e!r}") from e
    try:
        return unflatten_pages(kinds, await wait_ready(arrays, f"{peer} (jax transfer server {address})"))
    except BaseException:  # failed or timed out: the next pull from there starts on a new connection
        jax_endpoint.forget(address)
        raise
