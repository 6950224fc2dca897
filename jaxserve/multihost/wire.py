"""The leader's messages as bytes, authenticated: `encode` and `decode`.

Whoever reaches the coordination service's port can write its keys, so a message is data only, never code: a JSON
header and raw arrays of whitelisted dtypes, results as plain values rebuilt into their dataclasses, errors as a
whitelisted type name and a message. Each message carries an HMAC-SHA256 with a secret every process shares (always
required: see jaxserve.multihost.process.shared_secret) over the run's id, its sequence number and its content: a
forged, altered, replayed or reordered message, or one recorded in an earlier run with the same secret, ends the
follower that reads it, unexecuted. The run id is fresh each run, from every process (StepChannel's handshake).

`mac`, `sign` and `verified` are the HMAC underneath, for the channel's other keys (and anything else that needs a
value only the secret's holders could have written).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct

import numpy as np

from jaxserve.batch import RaggedRows, SamplingInput, StepInput, constant, is_constant
from jaxserve.multihost.messages import AbortMessage, EndMessage, ErrorMessage, Message, ShutdownMessage, StepMessage
from jaxserve.multihost.process import SECRET_ENV
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class MessageRefused(RuntimeError):
    """A message that failed its check: forged, altered, replayed, reordered or malformed. Never acted on."""


# ---- the wire format: MAC (32 bytes) | sequence number (8) | header length (4) | JSON header | raw arrays ----

_KINDS = {cls.kind: cls for cls in (StepMessage, EndMessage, ErrorMessage, AbortMessage, ShutdownMessage)}
_DTYPES = {"int32", "uint32", "float32", "bool"}  # all a StepInput holds
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, KeyError, IndexError, MemoryError,
                                   NotImplementedError, TimeoutError, KeyboardInterrupt)}
_NESTED = {"rows": RaggedRows, "sampling": SamplingInput}
_PREFIX = struct.Struct(">QI")
_MAC_BYTES = 32


def _sent(cls) -> list[dataclasses.Field]:
    """cls's fields a message carries: not those a step program sets on device (`jaxserve.batch`'s device_only)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("device_only")]


def _fields(cls=StepInput, prefix: str = "") -> list[str]:
    return [name for f in _sent(cls)
            for name in (_fields(_NESTED[f.name], f"{prefix}{f.name}.") if f.name in _NESTED else [prefix + f.name])]


_STEP_FIELDS = _fields()
_TRIMMED = ("rows.page_table", "sampling.past_tokens")


def _build(arrays: dict, cls=StepInput, prefix: str = ""):
    return cls(**{f.name: _build(arrays, _NESTED[f.name], f"{prefix}{f.name}.") if f.name in _NESTED
                  else arrays[prefix + f.name] for f in _sent(cls)})


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 with secret over parts, each prefixed with its length: no two lists of parts read the same."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(struct.pack(">Q", len(part)))
        h.update(part)
    return h.digest()


def sign(secret: bytes, value: bytes, *context: bytes) -> bytes:
    """value with its MAC in front, bound to context (what the value is: a key's name, the run): a value signed for
    one context does not verify in another."""
    return mac(secret, *context, value) + value


def verified(secret: bytes, data: bytes, *context: bytes) -> bytes | None:
    """The value `sign` signed in this context, or None where data was not signed so (forged, altered, moved)."""
    value = data[_MAC_BYTES:]
    return value if hmac.compare_digest(data[:_MAC_BYTES], mac(secret, *context, value)) else None


def encode(message: Message, seq: int, secret: bytes, run: bytes = b"") -> bytes:
    """One message as bytes, authenticated as message number seq of the run with id run. A result followers cannot
    receive (not plain data) is a TypeError, raised before anything is sent."""
    if not isinstance(message, tuple(_KINDS.values())):
        raise TypeError(f"not a message: {type(message).__name__}")
    header, buffers = {"kind": message.kind}, []
    if isinstance(message, StepMessage):
        arrays, constants, widths = {}, [], {}
        for name in _STEP_FIELDS:
            value = message.batch
            for part in name.split("."):
                value = getattr(value, part)
            if is_constant(value):  # an array no row uses (`jaxserve.batch.constant`): its recipe, not its bytes
                constants.append([name, value.dtype.name, list(value.shape), value.flat[0].item()])
            else:
                arrays[name] = np.asarray(value)
        # Arrays whose rows are padded at the end with one value (the page table with the scratch page, the past
        # tokens with vocab_size): sent up to their last column some row uses, for their full width is the most a
        # sequence can need, most of it unused by most steps. The follower pads them back to the compiled width.
        for name in _TRIMMED:
            if name in arrays and arrays[name].size:
                a = arrays[name]
                fill = a[0, -1].item()
                used = np.flatnonzero((a != fill).any(axis=0))
                arrays[name] = a[:, :int(used[-1]) + 1 if used.size else 0]
                widths[name] = [a.shape[1], fill]
        header.update(runner=int(message.runner_index), constants=constants, widths=widths)
        header["arrays"] = [[name, a.dtype.name, list(a.shape)] for name, a in arrays.items()]
        buffers = [np.ascontiguousarray(a).tobytes() for a in arrays.values()]
    elif isinstance(message, EndMessage):
        header["result"] = _plain_result(message.result)
    elif isinstance(message, ErrorMessage):
        error = message.error
        name = type(error).__name__
        header.update(type=name, message=str(error)) if name in _ERRORS else header.update(
            type="RuntimeError", message=f"{name}: {error}")
    elif isinstance(message, AbortMessage):
        header["message"] = str(message.reason)
    text = json.dumps(header).encode()
    body = _PREFIX.pack(seq, len(text)) + text + b"".join(buffers)
    return sign(secret, body, b"message", run)


def decode(data: bytes, seq: int, secret: bytes, run: bytes = b"") -> Message:
    """The message encode made for this run, once its MAC and sequence number check out; MessageRefused otherwise."""
    body = verified(secret, data, b"message", run)
    if body is None:
        raise MessageRefused(f"message {seq} failed authentication: it was not sent by process 0 of this run with "
                             f"this process's secret (every process needs the same ${SECRET_ENV} or "
                             "--coordinator-secret-file; a message recorded in an earlier run is refused too)")
    try:
        got, length = _PREFIX.unpack_from(body)
        if got != seq:
            raise MessageRefused(f"message {seq} carries sequence number {got}: a replayed or reordered message")
        start = _PREFIX.size + length
        header = json.loads(body[_PREFIX.size:start])
        return _message(header, memoryview(body)[start:])
    except MessageRefused:
        raise
    except Exception as e:  # noqa: BLE001 - an authentic but malformed message is a bug, reported as such
        raise MessageRefused(f"message {seq} is malformed ({type(e).__name__}: {e})") from e


def _message(header: dict, data: memoryview) -> Message:
    kind = header["kind"]
    if kind == "step":
        arrays, offset = {}, 0
        for name, dtype, shape in header["arrays"]:
            if name not in _STEP_FIELDS or name in arrays or dtype not in _DTYPES or len(shape) > 3:
                raise ValueError(f"unexpected array {name!r} ({dtype}, {shape})")
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if min(shape, default=0) < 0 or offset + size > len(data):
                raise ValueError(f"array {name!r} of shape {shape} overruns the message")
            arrays[name] = np.frombuffer(data[offset:offset + size], dtype).reshape(shape)
            offset += size
        for name, dtype, shape, fill in header["constants"]:
            if name not in _STEP_FIELDS or name in arrays or dtype not in _DTYPES or len(shape) > 3:
                raise ValueError(f"unexpected constant {name!r} ({dtype}, {shape})")
            arrays[name] = constant(tuple(shape), np.dtype(dtype), fill)
        if offset != len(data) or set(arrays) != set(_STEP_FIELDS):
            raise ValueError("the arrays do not make one step")
        for name, (width, fill) in header["widths"].items():  # back to the width the programs were compiled for
            a = arrays[name]
            arrays[name] = np.pad(a, ((0, 0), (0, int(width) - a.shape[1])), constant_values=fill)
        return StepMessage(int(header["runner"]), _build(arrays))
    if kind == "end":
        return EndMessage(_result(header["result"]))
    if kind == "error":
        return ErrorMessage(_ERRORS[header["type"]](header["message"]))
    if kind == "abort":
        return AbortMessage(str(header["message"]))
    if kind == "shutdown":
        return ShutdownMessage()
    raise ValueError(f"unknown message kind {kind!r}")


def _plain_result(result) -> dict:
    """What a collective phase returns (generate: RequestOutputs; stream: text pieces; warm-up: None; benchmarks:
    dicts of figures) as JSON."""
    if isinstance(result, list) and result and all(isinstance(r, RequestOutput) for r in result):
        outputs = []
        for r in result:
            plain = dataclasses.asdict(r)
            for c in plain["outputs"]:  # {token id: Logprob} per token: JSON keys are strings, so pairs
                if c["logprobs"] is not None:
                    c["logprobs"] = [list(entry.items()) for entry in c["logprobs"]]
            if plain.get("prompt_logprobs") is not None:  # the same, None for the first prompt token
                plain["prompt_logprobs"] = [None if e is None else list(e.items()) for e in plain["prompt_logprobs"]]
            outputs.append(plain)
        return {"outputs": outputs}
    try:
        plain = json.loads(json.dumps(result)) == result
    except (TypeError, ValueError):
        plain = False
    if not plain:
        raise TypeError(f"a collective phase returned a {type(result).__name__}, which followers cannot receive")
    return {"json": result}


def _result(plain: dict):
    if "json" in plain:
        return plain["json"]
    outputs = []
    for r in plain["outputs"]:
        completions = [CompletionOutput(**{**c, "logprobs": None if c["logprobs"] is None else [
            {int(t): Logprob(**lp) for t, lp in entry} for entry in c["logprobs"]]}) for c in r["outputs"]]
        metrics = None if r["metrics"] is None else RequestMetrics(**r["metrics"])
        prompt_logprobs = r.get("prompt_logprobs")
        if prompt_logprobs is not None:
            prompt_logprobs = [None if e is None else {int(t): Logprob(**lp) for t, lp in e} for e in prompt_logprobs]
        outputs.append(RequestOutput(**{**r, "outputs": completions, "metrics": metrics,
                                        "prompt_logprobs": prompt_logprobs}))
    return outputs

