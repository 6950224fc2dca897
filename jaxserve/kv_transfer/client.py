"""Fetches a transfer's KV pages from a KVServer (the decode server's side of the protocol in protocol.py)."""
from __future__ import annotations

import asyncio

from jaxserve.kv_transfer.codec import DTYPES, PREFIX, decode_pages, header_length, read_header
from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.jax_transfer import JaxTransferEndpoint, wait_ready
from jaxserve.kv_transfer.layout import check_shapes, unflatten_pages
from jaxserve.kv_transfer.protocol import frame, read_exactly, read_into, read_message


async def fetch_pages(host: str, port: int, transfer_id: str, timeout: float = 30.0,
                      jax_endpoint: JaxTransferEndpoint | None = None) -> list:
    """The KVPages held under transfer_id by the KVServer at host:port, taken from it (a second fetch fails).
    Without jax_endpoint: numpy arrays, sent as bytes with checksums. With one: the server's choice; jax arrays on
    the endpoint's device if it has a jax transfer server, numpy otherwise. KVTransferError on an unknown or expired
    id, a checksum mismatch, a refused, dropped or silent connection, or no pages within timeout seconds."""
    peer = f"KV server {host}:{port}"
    try:
        async with asyncio.timeout(timeout):
            return await _fetch(host, port, transfer_id, jax_endpoint, peer, timeout)
    except TimeoutError as e:
        raise KVTransferError(f"KV transfer {transfer_id!r} from {peer} timed out after {timeout} s") from e


async def _fetch(host, port, transfer_id, jax_endpoint, peer, timeout) -> list:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        raise KVTransferError(f"cannot connect to {peer}: {e}") from e
    try:
        request = {"transfer_id": transfer_id, "via": ["bytes"]}
        if jax_endpoint is not None:
            request = {"transfer_id": transfer_id, "via": ["jax", "bytes"], "jax_address": jax_endpoint.address}
        writer.write(frame(request))
        await writer.drain()
        reply = await read_message(reader, peer)
        if not reply.get("ok"):
            raise KVTransferError(f"{peer}: {reply.get('error', 'the fetch failed')}")
        if reply.get("via") == "jax":
            if jax_endpoint is None:
                raise KVTransferError(f"{peer} answered by the jax path, which this fetch did not offer")
            return await _pull(jax_endpoint, reply, peer, timeout)
        if reply.get("via") != "bytes":
            raise KVTransferError(f"{peer} answered by an unknown path {reply.get('via')!r}")
        return await _receive_bytes(reader, peer)
    except (ConnectionError, OSError) as e:
        raise KVTransferError(f"{peer} dropped the connection: {e!r}") from e
    finally:
        writer.close()


async def _receive_bytes(reader: asyncio.StreamReader, peer: str) -> list:
    prefix = await read_exactly(reader, PREFIX.size, peer, "the pages' prefix")
    prefix += await read_exactly(reader, header_length(prefix), peer, "the pages' header")
    payload_bytes = read_header(prefix)["payload_bytes"]
    data = bytearray(len(prefix) + payload_bytes)  # one buffer the decoded arrays view, read into in place
    data[:len(prefix)] = prefix
    await read_into(reader, memoryview(data)[len(prefix):], peer, "the pages")
    return await asyncio.to_thread(decode_pages, data)  # the checksum of 400 MB: 0.2 s off the loop


async def _pull(jax_endpoint: JaxTransferEndpoint, reply: dict, peer: str, timeout_s: float) -> list:
    try:
        kinds, address, uuid = reply["layers"], str(reply["address"]), int(reply["uuid"])
        specs = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in reply["arrays"]]
        check_shapes(kinds, specs)
        specs = [(shape, DTYPES[dtype]) for shape, dtype in specs]
    except (KeyError, TypeError, ValueError) as e:
        raise KVTransferError(f"{peer}: a malformed jax transfer reply: {e!r}") from e
    arrays = jax_endpoint.pull(address, uuid, specs, timeout_s)
    return unflatten_pages(kinds, await wait_ready(arrays, f"{peer} (jax transfer server {address})"))
