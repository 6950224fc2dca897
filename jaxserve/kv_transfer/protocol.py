"""The fetch protocol: a JSON message in a length-prefixed frame each way, then (bytes path) the pages as
codec.encode_pages writes them.

    client -> server: {"transfer_id": str, "via": ["jax", "bytes"] (the paths the client takes, best first),
                       "expires", "mac" (auth.fetch_auth: a server with a secret serves only its holders)}
    server -> client: {"ok": false, "error": str}
                    | {"ok": true, "via": "bytes"}, then the encoded pages
                    | {"ok": true, "via": "jax", "address", "uuid", "layers", "arrays"}: the client pulls the arrays
                      from the server's jax transfer server

Both ends use non-blocking sockets through the event loop's sock_* calls, not streams: the payload is received
straight into the buffer the decoded arrays view, and sent from the arrays' own memory. asyncio's streams copy a
payload three more times on the loop, in 256 KiB turns (measured: most of a fetch's time).
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct

from jaxserve.kv_transfer.errors import KVTransferError

FRAME = struct.Struct("<I")
MAX_MESSAGE_BYTES = 1 << 20  # a message is a header, never pages
MAX_REQUEST_BYTES = 4096  # a fetch request is a transfer id and a MAC: a server reserves no more for one
RECV_CHUNK_BYTES = 1 << 20  # a receive's most: the loop's turns stay short (a first touch of fresh pages is slow)


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return FRAME.pack(len(body)) + body


async def read_message(sock: socket.socket, peer: str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """The next message; KVTransferError if the stream ends, the length is past max_bytes (refused before anything
    is reserved for it) or the body is not an object."""
    length, = FRAME.unpack(await recv_exactly(sock, FRAME.size, peer, "a message's length"))
    if length > max_bytes:
        raise KVTransferError(f"a {length}-byte message from {peer} (at most {max_bytes})")
    body = await recv_exactly(sock, length, peer, "a message")
    try:
        message = json.loads(body)
    except ValueError as e:
        raise KVTransferError(f"a malformed message from {peer}: {e}") from e
    if not isinstance(message, dict):
        raise KVTransferError(f"a message from {peer} is not a JSON object")
    return message


async def recv_exactly(sock: socket.socket, n: int, peer: str, what: str) -> bytearray:
    buffer = bytearray(n)
    await recv_into(sock, memoryview(buffer), peer, what)
    return buffer


async def recv_into(sock: socket.socket, buffer: memoryview, peer: str, what: str) -> None:
    """Fills buffer from the socket (never reads past it); KVTransferError if the peer closes first."""
    loop = asyncio.get_running_loop()
    pos = 0
    while pos < len(buffer):
        n = await loop.sock_recv_into(sock, buffer[pos:pos + RECV_CHUNK_BYTES])
        if n == 0:
            raise KVTransferError(f"{peer} closed the connection after {pos} of {len(buffer)} bytes of {what}")
        pos += n


async def send_all(sock: socket.socket, *parts) -> None:
    loop = asyncio.get_running_loop()
    for part in parts:
        await loop.sock_sendall(sock, part)
