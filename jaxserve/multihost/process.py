"""Starting the processes of a multi-process run (`jax.distributed`), the secret they share, and ending them.

`initialize` starts JAX's multi-controller runtime with bounded failure detection; process 0's coordination service
binds one interface (the coordinator address's own, not all). Whoever reaches the coordination service's port can
write its keys, so the leader's messages are authenticated (jaxserve.multihost.wire) with a secret every process
shares (`shared_secret`), always required: a loopback service is reachable by every user of the host.

Failures are bounded by the coordination service's heartbeats: a process that dies or hangs stops sending them,
and the service then terminates every other process within about HEARTBEAT_TIMEOUT_S, printing which task stopped
(a process abort, not a Python exception: nothing can be caught). A Python error on one process must not leave it
waiting in the shutdown barrier while the others wait in a collective, so processes exit through `exit_now`.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import jax

from jaxserve.multihost.cluster_env import lws_bind_address, lws_cluster, lws_port
from jaxserve.options import AUTO_CLUSTER

logger = logging.getLogger("jaxserve")

HEARTBEAT_TIMEOUT_S = 10  # a dead or hung process is noticed in about this long (measured ~9 s)
SHUTDOWN_TIMEOUT_S = 15
SECRET_ENV = "JAXSERVE_COORDINATOR_SECRET"
MIN_SECRET_BYTES = 16

# A SIGTERM that came between initialize() and the run's own handler (see hold_sigterm).
_held_sigterm = threading.Event()


def initialize(coordinator_address: str, num_processes: int | None, process_id: int | None,
               bind_address: str | None = None) -> None:
    """jax.distributed.initialize, before anything starts JAX's backends, with bounded failure detection. Process
    0's coordination service binds bind_address (default: the coordinator address's own interface, not all).
    coordinator_address "auto" is JAX's cluster detection; "lws" or "lws:PORT" reads LeaderWorkerSet's variables
    (jaxserve.multihost.cluster_env), num_processes and process_id then None."""
    if jax.distributed.is_initialized():
        return
    if lws_port(coordinator_address) is not None:
        coordinator_address, num_processes, process_id = lws_cluster(coordinator_address, os.environ)
        bind_address = bind_address or lws_bind_address(coordinator_address)
    if coordinator_address == AUTO_CLUSTER:
        args = {} if bind_address is None else dict(coordinator_bind_address=bind_address)
    else:
        bind_address = bind_address or coordinator_address
        if process_id == 0:
            _warn_if_unreachable(bind_address, num_processes)
        args = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                    coordinator_bind_address=bind_address)
    jax.distributed.initialize(**args, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    hold_sigterm()
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def hold_sigterm() -> None:
    """From here until the run installs its own SIGTERM handler, a SIGTERM is remembered (`take_held_sigterm`)
    rather than swallowed by the preemption notifier jax.distributed.initialize installs: an orchestrator's SIGTERM
    that lands while the model loads still ends the run. Only the main thread can set a handler; elsewhere JAX's
    stays."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: _held_sigterm.set())


def take_held_sigterm() -> bool:
    """Whether a SIGTERM came since hold_sigterm(); forgets it."""
    held = _held_sigterm.is_set()
    _held_sigterm.clear()
    return held


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
    """The key messages are authenticated with: secret_file's content, else $JAXSERVE_COORDINATOR_SECRET. Always
    required, the processes on one host too: a service on loopback is reachable by every user of the host, and its
    port is easily found. scripts/launch_multihost.sh makes a fresh one for its processes."""
    if secret_file is not None:
        secret = Path(secret_file).read_bytes().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a multi-process run needs a shared secret of at least {MIN_SECRET_BYTES} bytes, the same "
                         f"on every process, in ${SECRET_ENV} or --coordinator-secret-file (e.g. `export {SECRET_ENV}="
                         "$(openssl rand -hex 16)`): without one, whoever reaches the coordinator's port, on this host "
                         "or another, can send steps to every process")
    return secret


def is_leader() -> bool:
    return jax.process_index() == 0


def exit_now(code: int = 1, message: str | None = None) -> None:
    """Leaves without JAX's shutdown barrier (which would hold this process until its timeout while the others
    wait in a collective that will never complete): the others then see this one stop and exit too."""
    if message:
        print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)
