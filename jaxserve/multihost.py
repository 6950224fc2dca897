"""One engine over several processes (JAX's multi-controller runtime, `jax.distributed`).

Every process runs the same step programs on the same global batch, each computing on its own devices' shards.
Process 0 (the leader) owns the scheduler, the tokenizer and the HTTP server; it publishes each step's batch, and
the others (followers) run what it published, in order. The batch goes through the coordination service's
key-value store as pickled host arrays (~1 ms a step, measured on localhost), not through a device collective: a
collective needs the same shapes on every process before it starts, and a batch's shapes vary with its bucket.

Failures are bounded by the coordination service's heartbeats: a process that dies or hangs stops sending them,
and the service then terminates every other process within about HEARTBEAT_TIMEOUT_S, printing which task stopped
(a process abort, not a Python exception: nothing can be caught). A Python error on one process must not leave it
waiting in the shutdown barrier while the others wait in a collective, so processes exit through `exit_now`.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import time

import jax

logger = logging.getLogger("jaxserve")

AUTO_CLUSTER = "auto"  # coordinator_address for JAX's own cluster detection (TPU pod slices, SLURM)
HEARTBEAT_TIMEOUT_S = 10  # a dead or hung process is noticed in about this long (measured ~9 s)
SHUTDOWN_TIMEOUT_S = 15
POLL_MS = 1000  # a follower's wait per read: an idle leader is not an error, only a silent death would be
KEEP_MESSAGES = 256  # published messages kept for followers that are behind (each is a few KB)


def initialize(coordinator_address: str, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed.initialize, before anything starts JAX's backends, with bounded failure detection."""
    if jax.distributed.is_initialized():
        return
    args = {} if coordinator_address == AUTO_CLUSTER else dict(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
    jax.distributed.initialize(**args, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """The leader's messages to its followers, in order: ("step", runner index, batch, scored) for each device
    step it dispatches, ("end", result) or ("error", exception) when a collective phase (a warm-up, a generate
    call) is over, ("shutdown",) at the end."""

    def __init__(self, name: str = "jaxserve"):
        from jax._src.distributed import global_state  # the coordination service's client: no public handle yet
        self._client = global_state.client
        self._prefix = f"{name}/message/"
        self._count = 0
        self.bytes_sent, self.seconds_sending = 0, 0.0  # the leader's cost of publishing (benchmarks)

    def send(self, message: tuple) -> None:
        start = time.perf_counter()
        data = pickle.dumps(message)
        self._client.key_value_set_bytes(f"{self._prefix}{self._count}", data)
        if self._count >= KEEP_MESSAGES:
            self._client.key_value_delete(f"{self._prefix}{self._count - KEEP_MESSAGES}")
        self._count += 1
        self.bytes_sent += len(data)
        self.seconds_sending += time.perf_counter() - start

    def receive(self) -> tuple:
        key = f"{self._prefix}{self._count}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - jaxlib's error type is not public
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise RuntimeError(f"lost the leader's message {self._count} ({e}); a follower more than "
                                       f"{KEEP_MESSAGES} messages behind cannot catch up") from e
        self._count += 1
        return pickle.loads(data)


def exit_now(code: int = 1, message: str | None = None) -> None:
    """Leaves without JAX's shutdown barrier (which would hold this process until its timeout while the others
    wait in a collective that will never complete): the others then see this one stop and exit too."""
    if message:
        print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)
