"""The device-to-device path: `jax.experimental.transfer` (jax 0.10.2), one transfer server per process. The side
holding pages offers them under a uuid (`await_pull`); the peer pulls them into its own device buffers over the
transfer server's sockets, with no host copy made by this code on either side.

Measured here (CPU, jax 0.10.2; tests/kv_transfer/test_kv_transfer.py): it works in one process and between two
processes, provided the server is started with transport addresses. Without them it uses an in-process transport, and a
pull from another process kills the serving process (`F socket-server.cc:360] Check failed: num_sys_refs_ != 0`), so
this module always passes them. A peer killed mid-pull fails the pull (`INTERNAL: SocketServer: Connection closed
recv() == 0`). But a pull of a uuid never offered (or whose offer timed out), or from an address where nothing
listens, does not fail: its arrays never become ready, and the pull's timeout argument does not end it. So the
fetch protocol offers a uuid only when the client asks, and the client bounds its wait itself. An offer not pulled
is dropped after its timeout (its memory freed: measured by the process's RSS).
"""
from __future__ import annotations

import asyncio
import datetime
import itertools
import threading

import jax
from jax.experimental import transfer

from jaxserve.kv_transfer.errors import KVTransferError

POLL_S = 0.005  # the longest wait between two looks at a pull's arrays (they start at 0.5 ms, doubling)


class JaxTransferEndpoint:
    """This process's transfer server: offers arrays to a peer and pulls a peer's onto `device`."""

    def __init__(self, host: str = "127.0.0.1", device: jax.Device | None = None):
        self.device = device or jax.local_devices()[0]
        self._server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"])
        self.address = self._server.address()
        self._uuids = itertools.count(1)
        self._connections: dict[str, transfer.TransferConnection] = {}
        self._lock = threading.Lock()

    def offer(self, arrays: list, timeout_s: float) -> int:
        """Makes arrays (numpy or jax) pullable once, for timeout_s; returns their uuid. Each is put whole on this
        endpoint's device first: the peer pulls one buffer an array (a sharded array would be several)."""
        arrays = [jax.device_put(a, self.device) for a in arrays]
        uuid = next(self._uuids)
        self._server.await_pull(uuid, arrays, timeout=_deadline(timeout_s))
        return uuid

    def pull(self, address: str, uuid: int, specs: list[tuple[tuple[int, ...], object]], timeout_s: float) -> list:
        """Starts pulling the arrays offered under uuid at address, specs [(shape, dtype)]; returns them at once
        (not ready: wait with `wait_ready`)."""
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in specs]
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            connection = self._connections[address]
        return connection.pull(uuid, structs, timeout=_deadline(timeout_s))

    def forget(self, address: str) -> None:
        """Drops the connection to address (a pull from it failed): a peer restarted there gets a new one."""
        with self._lock:
            self._connections.pop(address, None)


async def wait_ready(arrays: list, peer: str) -> list:
    """Awaits the pulled arrays without blocking the event loop: it polls `is_ready` (an error is ready too, raised
    by block_until_ready). Not a thread blocked in block_until_ready: a pull that never ends (see above) would park
    it for good, and a process with such a thread aborts at exit (measured: `terminate called after throwing an
    instance of ''`, exit code 134)."""
    delay = 0.0005
    while not all(a.is_ready() for a in arrays):
        await asyncio.sleep(delay)
        delay = min(2 * delay, POLL_S)
    try:
        return jax.block_until_ready(arrays)
    except jax.errors.JaxRuntimeError as e:
        raise KVTransferError(f"jax transfer from {peer} failed: {e}") from e


def _deadline(timeout_s: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
