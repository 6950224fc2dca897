"""KVPages as bytes and back: a checked header, then the arrays' raw bytes. No pickle: a decode server must not
run what a socket sends, so the header is JSON and names dtypes from a fixed list.

    MAGIC (4) | header length (u32 LE) | header crc32 (u32 LE) | header (JSON, utf-8) | payload

The header: {"version", "layers": ["dense" | "int8", ...], "arrays": [[shape, dtype name], ...], "payload_bytes",
"payload_crc32"}; the payload: each array's bytes, C order, little-endian, one after another. Both checksums are
crc32 (zlib: 2 GB/s here, 4x blake2b): they catch corruption in transit, which is the threat; a sender that means
harm controls the checksum anyway, and can make a decode only fail, never run anything.
"""
from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np

from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.layout import DTYPES, check_shapes, flatten_pages, unflatten_pages

MAGIC = b"JSKV"
VERSION = 1
PREFIX = struct.Struct("<4sII")  # magic, header length, header crc32
MAX_HEADER_BYTES = 1 << 20  # a header lists a few arrays per layer: a megabyte is far past any model's


def encoded_parts(kv) -> list[memoryview]:
    """encode_pages's bytes as parts (prefix and header, then each array's bytes) to write one after another
    without joining them: a socket writer sends a 400 MB transfer without a copy. kv: KVPages (numpy or jax arrays;
    jax arrays are copied to the host here)."""
    kinds, arrays = flatten_pages(kv)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    header = json.dumps({"version": VERSION, "layers": kinds,
                         "arrays": [[list(a.shape), a.dtype.name] for a in arrays],
                         "payload_bytes": sum(v.nbytes for v in views), "payload_crc32": crc}).encode()
    return [memoryview(PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header), *views]


def encode_pages(kv) -> bytes:
    """KVPages -> bytes (the layout above)."""
    return b"".join(encoded_parts(kv))


def read_header(prefix_and_header: bytes | memoryview) -> dict:
    """The header from the first bytes of an encoding (at least PREFIX.size + the header length; header_length
    tells how many from the prefix alone). Checked: magic, version, checksum, a KVPages layout, payload size."""
    length = header_length(prefix_and_header)
    header_bytes = bytes(prefix_and_header[PREFIX.size:PREFIX.size + length])
    if len(header_bytes) < length:
        raise KVTransferError(f"truncated KV transfer: {len(header_bytes)} of a {length}-byte header")
    if zlib.crc32(header_bytes) != PREFIX.unpack_from(prefix_and_header)[2]:
        raise KVTransferError("corrupt KV transfer: the header's checksum does not match")
    try:
        header = json.loads(header_bytes)
        specs = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in header["arrays"]]
        kinds, payload_bytes = header["layers"], int(header["payload_bytes"])
        int(header["payload_crc32"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"malformed KV transfer header: {e!r}") from e
    if header.get("version") != VERSION:
        raise KVTransferError(f"KV transfer version {header.get('version')!r}, this reader knows {VERSION}")
    check_shapes(kinds, specs)
    if payload_bytes != sum(math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in specs):
        raise KVTransferError(f"KV transfer header: payload_bytes {payload_bytes} is not the arrays' size")
    return header


def header_length(prefix: bytes | memoryview) -> int:
    """The header's length, from the PREFIX.size bytes that start an encoding."""
    if len(prefix) < PREFIX.size:
        raise KVTransferError(f"truncated KV transfer: {len(prefix)} bytes, shorter than its {PREFIX.size}-byte prefix")
    magic, length, _ = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise KVTransferError(f"not a KV transfer: it starts {bytes(magic)!r}, not {MAGIC!r}")
    if length > MAX_HEADER_BYTES:
        raise KVTransferError(f"KV transfer header of {length} bytes (at most {MAX_HEADER_BYTES})")
    return length


def decode_pages(data: bytes | bytearray | memoryview) -> list:
    """bytes -> KVPages of numpy arrays (read-only views into data: no copy). KVTransferError if corrupt, truncated
    or longer than its header says."""
    data = memoryview(data).cast("B")
    header = read_header(data)
    start = PREFIX.size + header_length(data)
    payload = data[start:]
    if len(payload) != header["payload_bytes"]:
        what = "truncated" if len(payload) < header["payload_bytes"] else "overlong"
        raise KVTransferError(f"{what} KV transfer: {len(payload)} payload bytes, its header says "
                              f"{header['payload_bytes']}")
    if zlib.crc32(payload) != header["payload_crc32"]:
        raise KVTransferError("corrupt KV transfer: the payload's checksum does not match")
    arrays, offset = [], 0
    for shape, dtype in header["arrays"]:
        dt = DTYPES[dtype]
        count = math.prod(shape)
        arrays.append(np.frombuffer(payload, dt, count, offset).reshape(shape))
        offset += count * dt.itemsize
    return unflatten_pages(header["layers"], arrays)
