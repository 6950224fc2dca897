"""What a safetensors file holds, read from its header alone: each tensor's dtype, shape and byte range, checked
against the file's size, so a file can be judged (and refused) before any of its data is read.

The format: an 8-byte little-endian header length n, n bytes of JSON ({name: {"dtype", "shape", "data_offsets":
[start, end]}}, and an optional "__metadata__"), then the tensors' bytes, packed in offset order with no gap.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

# Bytes per element of each safetensors dtype.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  # a key of ITEMSIZE
    shape: tuple[int, ...]
    start: int  # its bytes: [start, end) past the header
    end: int


def read_header(file: Path, max_header_bytes: int) -> dict[str, TensorInfo]:
    """The tensors `file` declares, by name. Reads at most 8 + max_header_bytes bytes, and only if the file's size is
    what the header declares (so a file padded with bytes no tensor owns is refused too). Raises ValueError saying
    what is wrong, OSError if the file cannot be read."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        n = int.from_bytes(prefix, "little")
        if n > max_header_bytes:
            raise ValueError(f"a {n}-byte header, above the {max_header_bytes} bytes an adapter of this model needs")
        if n > size - 8:
            raise ValueError(f"a {n}-byte header in a {size}-byte file")
        text = f.read(n)
    try:
        raw = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"the header is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("the header is not a JSON object")
    tensors = {name: _entry(name, value) for name, value in raw.items() if name != "__metadata__"}
    end = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != end:
            raise ValueError(f"{name}: its bytes start at {t.start}, not at {end} where the one before ends")
        end = t.end
    if 8 + n + end != size:
        raise ValueError(f"{size} bytes, but its header declares {8 + n + end}")
    return tensors


def _entry(name: str, value) -> TensorInfo:
    def bad(why: str):
        raise ValueError(f"{name}: {why}")
    if not isinstance(value, dict):
        bad("not a tensor entry")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in ITEMSIZE:
        bad(f"unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        bad(f"shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        bad(f"data_offsets {offsets!r} is not a [start, end] byte range")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEMSIZE[dtype]:
        bad(f"{offsets[1] - offsets[0]} bytes for a {dtype} tensor of shape {shape}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
