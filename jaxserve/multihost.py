"""One engine over several processes (JAX's multi-controller runtime, `jax.distributed`).

Every process runs the same step programs on the same global batch, each computing on its own devices' shards.
Process 0 (the leader) owns the scheduler, the tokenizer and the HTTP server; it publishes each step's batch, and
the others (followers) run what it published, in order. `LeaderFollower` is that protocol: the leader runs a
collective phase (a warm-up, a generate call, a stream) and publishes a `StepMessage` before each device step and
an `EndMessage` or `ErrorMessage` when the phase is over; a follower runs the steps and returns the leader's result
or raises its error. `AbortMessage` ends every process (the leader failed a step it had published), and
`ShutdownMessage` ends a follower that follows until the leader is done (a server's).

The messages go through the coordination service's key-value store (`StepChannel`; ~1 ms a step, measured on
localhost), not through a device collective: a collective needs the same shapes on every process before it
starts, and a batch's shapes vary with its bucket.

Whoever reaches the coordination service's port can write its keys, so a message is data only, never code: a JSON
header and raw arrays of whitelisted dtypes, results as plain values rebuilt into their dataclasses, errors as a
whitelisted type name and a message. Each message carries an HMAC-SHA256 over its sequence number and content with
a secret every process shares (required unless the service is reachable from this host only): a forged, altered,
replayed or reordered message ends the follower that reads it, unexecuted.

The leader keeps the last KEEP_MESSAGES messages for followers that are behind and deletes one only once every
follower has acknowledged reading it, so a burst of steps (a draft model catching up a long context) waits for slow
followers instead of overrunning them; a follower that still finds its next message gone stops with an error.

Failures are bounded by the coordination service's heartbeats: a process that dies or hangs stops sending them,
and the service then terminates every other process within about HEARTBEAT_TIMEOUT_S, printing which task stopped
(a process abort, not a Python exception: nothing can be caught). A Python error on one process must not leave it
waiting in the shutdown barrier while the others wait in a collective, so processes exit through `exit_now`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Union

import jax
import numpy as np

from jaxserve.batch import RaggedRows, SamplingInput, StepInput
from jaxserve.cache import SCRATCH_PAGE
from jaxserve.options import AUTO_CLUSTER
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

logger = logging.getLogger("jaxserve")

HEARTBEAT_TIMEOUT_S = 10  # a dead or hung process is noticed in about this long (measured ~9 s)
SHUTDOWN_TIMEOUT_S = 15
POLL_MS = 1000  # a follower's wait per read: an idle leader is not an error, only a silent death would be
KEEP_MESSAGES = 256  # published messages kept for followers that are behind
SECRET_ENV = "JAXSERVE_COORDINATOR_SECRET"
MIN_SECRET_BYTES = 16

# Whether the coordination service may be reachable from other hosts: JAX's own default binds every interface.
_exposed = True


def initialize(coordinator_address: str, num_processes: int | None, process_id: int | None,
               bind_address: str | None = None) -> None:
    """jax.distributed.initialize, before anything starts JAX's backends, with bounded failure detection. Process
    0's coordination service binds bind_address (default: the coordinator address's own interface, not all)."""
    global _exposed
    if jax.distributed.is_initialized():
        return
    if coordinator_address == AUTO_CLUSTER:
        args = {} if bind_address is None else dict(coordinator_bind_address=bind_address)
        _exposed = True  # the processes are on several hosts
    else:
        bind_address = bind_address or coordinator_address
        if process_id == 0:
            _warn_if_unreachable(bind_address, num_processes)
        args = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                    coordinator_bind_address=bind_address)
        _exposed = not (_is_loopback(coordinator_address) and _is_loopback(bind_address))
    jax.distributed.initialize(**args, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def _warn_if_unreachable(bind_address: str, num_processes: int | None) -> None:
    """A host name that resolves to loopback here (Debian's /etc/hosts maps the machine's own name to 127.0.1.1)
    makes the service unreachable from other hosts, which then wait for it until their start-up times out."""
    import socket
    host = bind_address.rsplit(":", 1)[0].strip("[]")
    if _is_loopback(bind_address) or (num_processes or 1) < 2:
        return
    try:
        ipaddress.ip_address(host)
        return  # an address literal means what it says
    except ValueError:
        pass
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        return
    if ipaddress.ip_address(resolved).is_loopback:
        logger.warning("the coordinator binds %s, which is %s (loopback) on this host: processes on other hosts "
                       "cannot reach it; give --coordinator-bind-address HOST_IP:PORT (or 0.0.0.0:PORT)",
                       bind_address, resolved)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def shared_secret(secret_file: str | None = None) -> bytes:
    """The key messages are authenticated with: secret_file's content, else $JAXSERVE_COORDINATOR_SECRET. Required
    when the coordination service may be reachable from another host; otherwise it may be empty."""
    if secret_file is not None:
        secret = Path(secret_file).read_bytes().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
    if _exposed and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a multi-host run needs a shared secret of at least {MIN_SECRET_BYTES} bytes, the same on "
                         f"every process, in ${SECRET_ENV} or --coordinator-secret-file: without one, whoever reaches "
                         "the coordinator's port can send steps to every process")
    return secret


def is_leader() -> bool:
    return jax.process_index() == 0


# ---- the leader's messages ----

@dataclasses.dataclass(frozen=True, eq=False)  # eq: a batch's arrays have no truth value
class StepMessage:
    """Run this device step: the batch the leader's runner number `runner_index` (in the order every process builds
    its runners) runs next."""
    runner_index: int
    batch: StepInput
    kind: ClassVar[str] = "step"


@dataclasses.dataclass(frozen=True)
class EndMessage:
    """A collective phase is over and returned `result`: a list of RequestOutputs (generate), of text pieces
    (stream), or JSON-able plain data (warm-up's None, a benchmark's figures)."""
    result: Any
    kind: ClassVar[str] = "end"


@dataclasses.dataclass(frozen=True)
class ErrorMessage:
    """A collective phase failed on the leader with `error`; followers raise it (a type they do not know as a
    RuntimeError naming it)."""
    error: BaseException
    kind: ClassVar[str] = "error"


@dataclasses.dataclass(frozen=True)
class AbortMessage:
    """The processes can no longer stay in step (the leader failed a step it had published): every one ends."""
    reason: str
    kind: ClassVar[str] = "abort"


@dataclasses.dataclass(frozen=True)
class ShutdownMessage:
    """No more steps: a follower following until shutdown returns."""
    kind: ClassVar[str] = "shutdown"


Message = Union[StepMessage, EndMessage, ErrorMessage, AbortMessage, ShutdownMessage]
_KINDS = {cls.kind: cls for cls in (StepMessage, EndMessage, ErrorMessage, AbortMessage, ShutdownMessage)}


class MessageRefused(RuntimeError):
    """A message that failed its check: forged, altered, replayed, reordered or malformed. Never acted on."""


# ---- the wire format: MAC (32 bytes) | sequence number (8) | header length (4) | JSON header | raw arrays ----

_DTYPES = {"int32", "uint32", "float32", "bool"}  # all a StepInput holds
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, KeyError, IndexError, MemoryError,
                                   NotImplementedError, TimeoutError, KeyboardInterrupt)}
_NESTED = {"rows": RaggedRows, "sampling": SamplingInput}
_PREFIX = struct.Struct(">QI")
_MAC_BYTES = 32


def _fields(cls=StepInput, prefix: str = "") -> list[str]:
    return [name for f in dataclasses.fields(cls)
            for name in (_fields(_NESTED[f.name], f"{prefix}{f.name}.") if f.name in _NESTED else [prefix + f.name])]


_STEP_FIELDS = _fields()


def _build(arrays: dict, cls=StepInput, prefix: str = ""):
    return cls(**{f.name: _build(arrays, _NESTED[f.name], f"{prefix}{f.name}.") if f.name in _NESTED
                  else arrays[prefix + f.name] for f in dataclasses.fields(cls)})


def encode(message: Message, seq: int, secret: bytes) -> bytes:
    """One message as bytes, authenticated as the channel's message number seq. A result followers cannot receive
    (not plain data) is a TypeError, raised before anything is sent."""
    if not isinstance(message, tuple(_KINDS.values())):
        raise TypeError(f"not a message: {type(message).__name__}")
    header, buffers = {"kind": message.kind}, []
    if isinstance(message, StepMessage):
        arrays = {}
        for name in _STEP_FIELDS:
            value = message.batch
            for part in name.split("."):
                value = getattr(value, part)
            arrays[name] = np.asarray(value)
        # Only the columns of the page table some row uses (the rest is the scratch page): the table's full width
        # is pages_per_row, most of it unused by most steps. The follower pads it back to the compiled width.
        table = arrays["rows.page_table"]
        used = np.flatnonzero((table != SCRATCH_PAGE).any(axis=0))
        width = int(used[-1]) + 1 if used.size else 0
        header.update(runner=int(message.runner_index), page_table_width=table.shape[1])
        arrays["rows.page_table"] = table[:, :width]
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
    return hmac.digest(secret, body, hashlib.sha256) + body


def decode(data: bytes, seq: int, secret: bytes) -> Message:
    """The message encode made, once its MAC and sequence number check out; MessageRefused otherwise."""
    mac, body = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.digest(secret, body, hashlib.sha256)):
        raise MessageRefused(f"message {seq} failed authentication: it was not sent by process 0 with this "
                             f"process's secret (every process needs the same ${SECRET_ENV} or "
                             "--coordinator-secret-file)")
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
        if offset != len(data) or set(arrays) != set(_STEP_FIELDS):
            raise ValueError("the arrays do not make one step")
        table = arrays["rows.page_table"]  # back to the width the programs were compiled for
        arrays["rows.page_table"] = np.pad(table, ((0, 0), (0, int(header["page_table_width"]) - table.shape[1])),
                                           constant_values=SCRATCH_PAGE)
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
        outputs.append(RequestOutput(**{**r, "outputs": completions, "metrics": metrics}))
    return outputs


class StepChannel:
    """The leader's messages to its followers, in order, through the coordination service's key-value store: the
    leader `send`s, each follower `receive`s every message (see `LeaderFollower` for what they mean).

    A follower acknowledges every ack_every() messages it has read; the leader deletes a message only once every
    follower has acknowledged it, waiting for them if need be. client, process_index, process_count: the
    coordination service's client and this process's place (default: jax.distributed's)."""

    def __init__(self, secret: bytes, name: str = "jaxserve", client=None, process_index: int | None = None,
                 process_count: int | None = None):
        if client is None:
            from jax._src.distributed import global_state  # the coordination service's client: no public handle yet
            client = global_state.client
        self._client = client
        self._secret = secret
        self._me = jax.process_index() if process_index is None else process_index
        count = jax.process_count() if process_count is None else process_count
        self._followers = range(1, count)
        self._prefix, self._acks, self._oldest = f"{name}/message/", f"{name}/ack/", f"{name}/oldest"
        self._stop_key = f"{name}/stop"
        self._count = 0
        self._acked = 0  # messages every follower has acknowledged reading (the leader's)
        self.bytes_sent, self.seconds_sending = 0, 0.0  # the leader's cost of publishing (benchmarks)
        self._watching = False

    def send(self, message: Message) -> None:
        """On the leader: publishes the next message (waiting, if KEEP_MESSAGES are unread, for the followers)."""
        start = time.perf_counter()
        n = self._count
        data = encode(message, n, self._secret)
        if n >= KEEP_MESSAGES:
            self._wait_for_followers(n - KEEP_MESSAGES + 1)
        self._client.key_value_set_bytes(f"{self._prefix}{n}", data)
        if n >= KEEP_MESSAGES:
            self._client.key_value_delete(f"{self._prefix}{n - KEEP_MESSAGES}")
            self._client.key_value_set_bytes(self._oldest, str(n - KEEP_MESSAGES + 1).encode(), allow_overwrite=True)
        self._count += 1
        self.bytes_sent += len(data)
        self.seconds_sending += time.perf_counter() - start

    def _wait_for_followers(self, needed: int) -> None:
        """Until every follower has read `needed` messages (and so may lose the oldest of them)."""
        if self._acked >= needed:
            return
        every = ack_every()
        target = -(-needed // every) * every  # the acknowledgement that covers it (<= messages published)
        waited = time.monotonic()
        for follower in self._followers:
            key = f"{self._acks}{follower}/{target}"
            while _get(self._client, key) is None:
                if time.monotonic() - waited > 60:
                    logger.warning("process 0 has waited %.0f s for process %d to catch up", time.monotonic() - waited,
                                   follower)
                    waited = time.monotonic()
            self._client.key_value_delete(key)
        self._acked = target

    def receive(self) -> Message:
        """On a follower: the leader's next message, once it is published. MessageRefused if it is not authentic,
        RuntimeError if it was deleted unread."""
        n = self._count
        while (data := _get(self._client, f"{self._prefix}{n}")) is None:
            oldest = _try_get(self._client, self._oldest)
            if oldest is not None and int(oldest) > n:
                raise RuntimeError(f"process {self._me} lost the leader's message {n}: it was deleted before this "
                                   "process read it, so this process cannot follow")
        message = decode(data, n, self._secret)
        self._count += 1
        if self._count % ack_every() == 0:
            self._client.key_value_set_bytes(f"{self._acks}{self._me}/{self._count}", b"1")
        return message

    def abort(self, reason: str) -> None:
        """The leader cannot keep the processes in step (it failed a step it had published): tells the followers,
        and ends this process. Never returns."""
        try:
            if self._acked > self._count - KEEP_MESSAGES:  # never wait on followers stuck in the failed step
                self.send(AbortMessage(reason))
        finally:
            exit_now(1, f"jaxserve: error: {reason}; every process ends, as they are no longer in step")

    def request_stop(self) -> None:
        """A follower's SIGTERM: asks the leader to end the run (as its own SIGTERM would)."""
        self._client.key_value_set_bytes(self._stop_key, str(self._me).encode(), allow_overwrite=True)

    def watch_stop_requests(self, on_request) -> None:
        """On the leader: calls on_request() (on another thread) once a follower asks to stop, until close()."""
        def watch():
            while self._watching:
                try:
                    self._client.blocking_key_value_get_bytes(self._stop_key, POLL_MS)
                except Exception as e:  # noqa: BLE001 - jaxlib's error type is not public
                    if "DEADLINE_EXCEEDED" in str(e):
                        continue
                    return  # the client is shutting down
                if self._watching:
                    on_request()
                return
        self._watching = True
        self._watcher = threading.Thread(target=watch, name="jaxserve-stop-requests", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        if self._watching:
            self._watching = False
            self._watcher.join()



class LeaderFollower:
    """The leader/follower protocol: how every process takes part in a collective phase (a warm-up, a generate
    call, a stream) that only the leader schedules.

    On the leader, `run(fn)` runs fn, which publishes each device step before it runs it (`lead_step`, or
    `publish_step` then the step), then publishes fn's result (EndMessage) or error (ErrorMessage). On a follower,
    `run(fn)` does not call fn: it runs the published steps as they come, each with `run_step(runner_index, batch)`
    (waited for: in step with the leader, not queued), and returns the leader's result or raises its error. A
    run() inside another's fn is part of the outer phase. `follow()` follows every phase until the leader's
    `shutdown()` (a server's followers). A step the leader fails after publishing it ends every process (`abort`).

    channel None (one process): run(fn) is fn(), a step is just run, and nothing is published.
    """

    def __init__(self, channel: StepChannel | None, is_leader: bool,
                 run_step: Callable[[int, StepInput], Any] | None = None):
        """run_step(runner_index, batch): runs a published step on this process's runner of that index and returns
        its output (the follower waits for it); needed on followers only."""
        self.channel = channel
        self._is_leader = is_leader
        self._run_step = run_step
        self._in_phase = False

    @classmethod
    def for_this_process(cls, run_step: Callable[[int, StepInput], Any] | None = None,
                         secret_file: str | None = None) -> "LeaderFollower":
        """After `initialize` (or in a single process): a channel over jax.distributed's coordination service if
        there are several processes, authenticated with shared_secret(secret_file)."""
        channel = StepChannel(shared_secret(secret_file)) if jax.process_count() > 1 else None
        return cls(channel, is_leader(), run_step)

    @property
    def is_leader(self) -> bool:
        """Process 0, which schedules (True in a single process)."""
        return self._is_leader

    @property
    def multi_process(self) -> bool:
        return self.channel is not None

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of a multi-process run: it runs the leader's steps, never its own."""
        return self.channel is not None and not self._is_leader

    def run(self, fn: Callable[[], Any]):
        """fn's device work on every process: fn()'s result on every process (on followers, the leader's, received)
        or its error raised. One process: just fn()."""
        if self.channel is None or self._in_phase:  # one phase: a generate inside another's fn is part of it
            return fn()
        if not self._is_leader:
            return self._follow()
        self._in_phase = True
        try:
            result = fn()
        except BaseException as e:
            self.channel.send(ErrorMessage(e))
            raise
        finally:
            self._in_phase = False
        self.channel.send(EndMessage(result))
        return result

    def stream(self, pieces: Callable[[], Iterable[str]]) -> Iterator[str]:
        """A streaming phase: on the leader, yields what pieces() yields and, however the stream ends (finished,
        failed, or closed by its consumer), publishes those yielded as the phase's result (end_stream); on a
        follower, yields the leader's pieces once its stream is over. One process: pieces()."""
        if self.is_follower:
            yield from self._follow()
            return
        yielded = []
        try:
            for piece in pieces():
                yielded.append(piece)
                yield piece
        finally:
            self.end_stream(yielded)

    def end_stream(self, pieces: list[str]) -> None:
        """On the leader: a stream is over, with these text pieces (what a follower's stream yields). Nothing in a
        single process."""
        if self.channel is not None and self._is_leader:
            self.channel.send(EndMessage(pieces))

    def publish_step(self, runner_index: int, batch: StepInput) -> None:
        """On the leader, before it runs a step on its runner of this index: every follower runs it too. Nothing in
        a single process."""
        if self.channel is None:
            return
        if not self._is_leader:
            raise RuntimeError("a follower runs the leader's steps: it publishes none")
        self.channel.send(StepMessage(runner_index, batch))

    def lead_step(self, runner_index: int, batch: StepInput, run: Callable[[StepInput], Any]):
        """run(batch) on the leader, published first: its output. If it fails once published, every process ends
        (abort): the followers run it regardless, so no later step could line up."""
        if self.channel is None:
            return run(batch)
        self.publish_step(runner_index, batch)
        try:
            return run(batch)
        except BaseException as e:
            self.abort(f"process 0 failed a step it had sent to the other processes ({type(e).__name__}: {e})")

    def abort(self, reason: str) -> None:
        """On the leader, which failed a step it had published: tells the followers, and ends this process. Never
        returns."""
        if self.channel is None or not self._is_leader:
            raise RuntimeError("abort is for the leader of a multi-process run")
        self.channel.abort(reason)

    def follow(self) -> None:
        """On a follower: run the leader's steps until it shuts down (`jaxserve serve` on processes other than 0)."""
        if not self.is_follower:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        self._follow(until_shutdown=True)

    def _follow(self, until_shutdown: bool = False):
        """Runs the leader's steps as they come, to the end of its current phase (its result, or its error raised)
        or, until_shutdown, of all of them."""
        while True:
            message = self.channel.receive()
            if isinstance(message, StepMessage):
                jax.block_until_ready(self._run_step(message.runner_index, message.batch))
            elif isinstance(message, ShutdownMessage):
                return None
            elif isinstance(message, AbortMessage):  # the leader failed a step this process ran: out of step
                exit_now(1, f"jaxserve: error: {message.reason}")
            elif until_shutdown:
                continue
            elif isinstance(message, EndMessage):
                return message.result
            else:
                raise message.error

    def shutdown(self) -> None:
        """On the leader: tells the followers there are no more steps, and stops watching for stop requests.
        Nothing elsewhere."""
        if self.channel is not None and self._is_leader:
            self.channel.send(ShutdownMessage())
            self.channel.close()

    def request_stop(self) -> None:
        """On a follower (its SIGTERM): asks the leader to end the run."""
        self.channel.request_stop()

    def watch_stop_requests(self, on_request: Callable[[], None]) -> None:
        """On the leader: on_request() (on another thread) once a follower asks to stop, until shutdown()."""
        self.channel.watch_stop_requests(on_request)

def ack_every() -> int:
    """A follower acknowledges every this many messages: a quarter of the window, so the leader rarely waits."""
    return max(1, KEEP_MESSAGES // 4)


def _get(client, key: str) -> bytes | None:
    """The key's value, waiting up to POLL_MS for it (None if it did not come)."""
    try:
        return client.blocking_key_value_get_bytes(key, POLL_MS)
    except Exception as e:  # noqa: BLE001 - jaxlib's error type is not public
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise RuntimeError(f"lost the coordination service reading {key} ({e})") from e


def _try_get(client, key: str) -> bytes | None:
    try:
        return client.key_value_try_get_bytes(key)
    except Exception as e:  # noqa: BLE001
        if "NOT_FOUND" in str(e):
            return None
        raise


def exit_now(code: int = 1, message: str | None = None) -> None:
    """Leaves without JAX's shutdown barrier (which would hold this process until its timeout while the others
    wait in a collective that will never complete): the others then see this one stop and exit too."""
    if message:
        print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)
