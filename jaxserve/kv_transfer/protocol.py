"""The fetch protocol's messages: a JSON object in a length-prefixed frame, each way.

    client -> server: {"transfer_id": str, "via": ["jax", "bytes"] (the paths the client takes, best first),
                       "jax_address": str (when it offers "jax")}
    server -> client: {"ok": false, "error": str}
                    | {"ok": true, "via": "bytes"}, then the pages as codec.encode_pages writes them
                    | {"ok": true, "via": "jax", "address", "uuid", "layers", "arrays"}: the client pulls the arrays
                      from the server's jax transfer server
"""
from __future__ import annotations

import asyncio
import json
import struct

from jaxserve.kv_transfer.errors import KVTransferError

FRAME = struct.Struct("<I")
MAX_MESSAGE_BYTES = 1 << 20  # a message is a header, never pages


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return FRAME.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, peer: str) -> dict:
    """The next message; KVTransferError if the stream ends, the length is absurd or the body is not an object."""
    length, = FRAME.unpack(await read_exactly(reader, FRAME.size, peer, "a message's length"))
    if length > MAX_MESSAGE_BYTES:
        raise KVTransferError(f"a {length}-byte message from {peer} (at most {MAX_MESSAGE_BYTES})")
    body = await read_exactly(reader, length, peer, "a message")
    try:
        message = json.loads(body)
    except ValueError as e:
        raise KVTransferError(f"a malformed message from {peer}: {e}") from e
    if not isinstance(message, dict):
        raise KVTransferError(f"a message from {peer} is not a JSON object")
    return message


async def read_exactly(reader: asyncio.StreamReader, n: int, peer: str, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise KVTransferError(f"{peer} closed the connection after {len(e.partial)} of {n} bytes of {what}") from e


async def read_into(reader: asyncio.StreamReader, buffer: memoryview, peer: str, what: str) -> None:
    """Fills buffer from the stream in chunks: a 400 MB payload is read without a second whole copy."""
    pos = 0
    while pos < len(buffer):
        chunk = await reader.read(min(len(buffer) - pos, 1 << 22))
        if not chunk:
            raise KVTransferError(f"{peer} closed the connection after {pos} of {len(buffer)} bytes of {what}")
        buffer[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
