"""`StepChannel`: the leader's messages to its followers, in order, through the coordination service's key-value store.

The messages go through the key-value store (~1 ms a step, measured on localhost), not through a device collective:
a collective needs the same shapes on every process before it starts, and a batch's shapes vary with its bucket.

The leader keeps the last KEEP_MESSAGES messages for followers that are behind and deletes one only once every
follower has acknowledged reading it, so a burst of steps (a draft model catching up a long context) waits for slow
followers instead of overrunning them; a follower that still finds its next message gone stops with an error.
KEEP_MESSAGES and POLL_MS are read here, when used: set them on this module.
"""
from __future__ import annotations

import logging
import threading
import time

import jax

from jaxserve.multihost import process
from jaxserve.multihost.messages import AbortMessage, Message
from jaxserve.multihost.wire import decode, encode

logger = logging.getLogger("jaxserve")

POLL_MS = 1000  # a follower's wait per read: an idle leader is not an error, only a silent death would be
KEEP_MESSAGES = 256  # published messages kept for followers that are behind


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
            process.exit_now(1, f"jaxserve: error: {reason}; every process ends, as they are no longer in step")

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

