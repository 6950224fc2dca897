"""`StepChannel`: the leader's messages to its followers, in order, through the coordination service's key-value store.

The messages go through the key-value store (~1 ms a step, measured on localhost), not through a device collective:
a collective needs the same shapes on every process before it starts, and a batch's shapes vary with its bucket.

The leader keeps the last KEEP_MESSAGES messages for followers that are behind and deletes one only once every
follower has acknowledged reading it, so a burst of steps (a draft model catching up a long context) waits for slow
followers instead of overrunning them; a follower that still finds its next message gone stops with an error.
KEEP_MESSAGES and POLL_MS are read here, when used: set them on this module.

Every value the channel writes is authenticated with the shared secret and bound to this run, so that neither a
stranger who reaches the service nor a recording of an earlier run with the same secret can steer it. The run's id
comes from every process: each follower writes a random nonce of its own (`hello`); on its first message the leader
adds its own nonce and publishes all of them, signed, as the run id (`run`); a follower takes the run id only if
its signature checks out and it holds this follower's nonce, which no earlier run's can. Each message's MAC covers
the run id, so a message recorded in an earlier run fails it; so do the acknowledgements (`ack`) and the oldest
message kept (`oldest`). A stop request (`stop`) is signed with its follower's nonce: it may come before any message.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import jax

from jaxserve.multihost import process
from jaxserve.multihost.messages import AbortMessage, Message
from jaxserve.multihost.wire import MessageRefused, decode, encode, sign, verified

logger = logging.getLogger("jaxserve")

POLL_MS = 1000  # a follower's wait per read: an idle leader is not an error, only a silent death would be
KEEP_MESSAGES = 256  # published messages kept for followers that are behind
NONCE_BYTES = 16


class StepChannel:
    """The leader's messages to its followers, in order, through the coordination service's key-value store: the
    leader `send`s, each follower `receive`s every message (see `LeaderFollower` for what they mean).

    A follower acknowledges every ack_every() messages it has read; the leader deletes a message only once every
    follower has acknowledged it, waiting for them if need be. client, process_index, process_count: the
    coordination service's client and this process's place (default: jax.distributed's)."""

    def __init__(self, secret: bytes, name: str = "jaxserve", client=None, process_index: int | None = None,
                 process_count: int | None = None):
        if len(secret) < process.MIN_SECRET_BYTES:
            raise ValueError(f"the processes' messages need a shared secret of at least {process.MIN_SECRET_BYTES} "
                             f"bytes, got {len(secret)}")
        if client is None:
            from jax._src.distributed import global_state  # the coordination service's client: no public handle yet
            client = global_state.client
        self._client = client
        self._secret = secret
        self._name = name
        self._me = jax.process_index() if process_index is None else process_index
        count = jax.process_count() if process_count is None else process_count
        self._followers = range(1, count)
        self._prefix, self._acks, self._oldest = f"{name}/message/", f"{name}/ack/", f"{name}/oldest"
        self._stop_key, self._hello, self._run_key = f"{name}/stop", f"{name}/hello/", f"{name}/run"
        self._nonce = os.urandom(NONCE_BYTES)
        self._run: bytes | None = None  # the run's id, once the leader has published it
        if self._me != 0:  # the follower's part of the run id, there before the leader's first message needs it
            self._client.key_value_set_bytes(f"{self._hello}{self._me}", self._nonce, allow_overwrite=True)
        self._count = 0
        self._acked = 0  # messages every follower has acknowledged reading (the leader's)
        self.bytes_sent, self.seconds_sending = 0, 0.0  # the leader's cost of publishing (benchmarks)
        self._watching = False

    def send(self, message: Message) -> None:
        """On the leader: publishes the next message (waiting, if KEEP_MESSAGES are unread, for the followers)."""
        start = time.perf_counter()
        n = self._count
        run = self._run or self._start_run()
        data = encode(message, n, self._secret, run)
        if n >= KEEP_MESSAGES:
            self._wait_for_followers(n - KEEP_MESSAGES + 1)
        self._client.key_value_set_bytes(f"{self._prefix}{n}", data)
        if n >= KEEP_MESSAGES:
            self._client.key_value_delete(f"{self._prefix}{n - KEEP_MESSAGES}")
            oldest = str(n - KEEP_MESSAGES + 1).encode()
            self._client.key_value_set_bytes(self._oldest, sign(self._secret, oldest, b"oldest", run),
                                             allow_overwrite=True)
        self._count += 1
        self.bytes_sent += len(data)
        self.seconds_sending += time.perf_counter() - start

    def _start_run(self) -> bytes:
        """On the leader, before its first message: the run id (its nonce and every follower's, in process order),
        published signed. Waits for followers that have not written their nonce yet."""
        nonces = [self._nonce]
        for follower in self._followers:
            waited = time.monotonic()
            while (nonce := _get(self._client, f"{self._hello}{follower}")) is None:
                if time.monotonic() - waited > 60:
                    logger.warning("process 0 has waited %.0f s for process %d to join", time.monotonic() - waited,
                                   follower)
                    waited = time.monotonic()
            nonces.append(nonce[:NONCE_BYTES].ljust(NONCE_BYTES, b"\0"))
        run = b"".join(nonces)
        self._client.key_value_set_bytes(self._run_key, sign(self._secret, run, b"run", self._name.encode()))
        self._run = run
        return run

    def _join_run(self) -> bytes:
        """On a follower, before its first message: the run id the leader published, once it checks out (signed
        with the secret, and holding this follower's nonce: no earlier run's does)."""
        while (data := _get(self._client, self._run_key)) is None:
            pass
        run = verified(self._secret, data, b"run", self._name.encode())
        mine = slice(self._me * NONCE_BYTES, (self._me + 1) * NONCE_BYTES)
        if run is None or len(run) % NONCE_BYTES or run[mine] != self._nonce:
            raise MessageRefused(f"process {self._me} refused the run id: "
                                 f"{'not signed with this secret' if run is None else 'not this run of the processes'}"
                                 " (every process needs the same secret; a recording of an earlier run is refused)")
        self._run = run
        return run

    def _authentic(self, data: bytes, what: str, *context: bytes) -> bytes:
        """The value signed in this run for context; MessageRefused naming `what` otherwise."""
        value = verified(self._secret, data, *context, self._run or b"")
        if value is None:
            raise MessageRefused(f"{what} failed authentication: not written by process 0 of this run")
        return value

    def _authentic_ack(self, data: bytes, key: str) -> bool:
        """Whether an acknowledgement was signed by a process of this run (else it is removed, and waited for)."""
        if verified(self._secret, data, key.encode(), self._run or b"") is not None:
            return True
        logger.warning("an acknowledgement at %s that no process of this run signed: ignored", key)
        self._client.key_value_delete(key)
        return False

    def _authentic_stop(self, data: bytes) -> bool:
        """Whether a stop request was signed by the follower it names, with its nonce of this run."""
        for follower in self._followers:
            nonce = _try_get(self._client, f"{self._hello}{follower}")
            if nonce is None or (self._run is not None and nonce != self._run[follower * NONCE_BYTES:][:NONCE_BYTES]):
                continue
            if verified(self._secret, data, b"stop", nonce) == str(follower).encode():
                return True
        return False

    def _wait_for_followers(self, needed: int) -> None:
        """Until every follower has read `needed` messages (and so may lose the oldest of them)."""
        if self._acked >= needed:
            return
        every = ack_every()
        target = -(-needed // every) * every  # the acknowledgement that covers it (<= messages published)
        waited = time.monotonic()
        for follower in self._followers:
            key = f"{self._acks}{follower}/{target}"
            while (ack := _get(self._client, key)) is None or not self._authentic_ack(ack, key):
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
        run = self._run or self._join_run()
        while (data := _get(self._client, f"{self._prefix}{n}")) is None:
            oldest = _try_get(self._client, self._oldest)
            if oldest is not None and int(self._authentic(oldest, "the oldest message's number", b"oldest")) > n:
                raise RuntimeError(f"process {self._me} lost the leader's message {n}: it was deleted before this "
                                   "process read it, so this process cannot follow")
        message = decode(data, n, self._secret, run)
        self._count += 1
        if self._count % ack_every() == 0:
            key = f"{self._acks}{self._me}/{self._count}"
            self._client.key_value_set_bytes(key, sign(self._secret, b"1", key.encode(), run))
        return message

    def abort(self, reason: str) -> None:
        """The leader cannot keep the processes in step (it failed a step it had published): tells the followers,
        and ends this process. Never returns."""
        try:
            if self._acked > self._count - KEEP_MESSAGES:  # never wait on followers stuck in the failed step
                self.send(AbortMessage(reason))
        finally:
            process.exit_now(1, f"jaxserve: error: {reason}; every process ends, as they are no longer in step")

    def request_stop(self) -> None:
        """A follower's SIGTERM: asks the leader to end the run (as its own SIGTERM would)."""
        me = str(self._me).encode()
        self._client.key_value_set_bytes(self._stop_key, sign(self._secret, me, b"stop", self._nonce),
                                         allow_overwrite=True)

    def watch_stop_requests(self, on_request) -> None:
        """On the leader: calls on_request() (on another thread) once a follower asks to stop, until close()."""
        def watch():
            while self._watching:
                try:
                    request = self._client.blocking_key_value_get_bytes(self._stop_key, POLL_MS)
                except Exception as e:  # noqa: BLE001 - jaxlib's error type is not public
                    if "DEADLINE_EXCEEDED" in str(e):
                        continue
                    return  # the client is shutting down
                if not self._authentic_stop(request):
                    logger.warning("a stop request that no process of this run signed: ignored")
                    self._client.key_value_delete(self._stop_key)
                    continue
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

