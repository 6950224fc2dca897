"""A multi-process run's processes from the environment a cluster manager gives them: Kubernetes LeaderWorkerSet's.

LeaderWorkerSet (LWS) starts each group as one leader pod and LWS_GROUP_SIZE - 1 workers, and sets in every pod
LWS_LEADER_ADDRESS (the leader pod's DNS name in the group's headless service), LWS_GROUP_SIZE (pods in the group) and
LWS_WORKER_INDEX (this pod's index, 0 the leader). `--coordinator-address lws` (or `lws:PORT`) reads them, so a
manifest passes the same command to every pod, with no arithmetic in shell. These are plain functions of the
address and an environment mapping (no JAX), checked by EngineConfig before anything loads and applied by
`jaxserve.multihost.process.initialize`.

Where the leader's coordination service listens (`lws_bind_address`): the leader's name resolves through the
cluster's DNS, whose record may not be there yet when the leader starts, and a pod's network namespace holds only
its own interfaces; so a name binds every interface of the pod, as JAX's own default does. An address literal
(127.0.0.1 for processes on one host) is bound as it is, keeping a loopback run on loopback.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

from jaxserve.options import LWS_CLUSTER, LWS_DEFAULT_PORT

LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"

_DIGITS = re.compile(r"[0-9]+")


def lws_port(coordinator_address: str | None) -> int | None:
    """The coordinator's port if coordinator_address asks for the LWS contract ("lws": LWS_DEFAULT_PORT, or
    "lws:PORT"), else None; a port that is not an integer in 1-65535 is a ValueError."""
    if coordinator_address is None or coordinator_address.split(":", 1)[0] != LWS_CLUSTER:
        return None
    if coordinator_address == LWS_CLUSTER:
        return LWS_DEFAULT_PORT
    port = coordinator_address.split(":", 1)[1]
    if not _DIGITS.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator_address {coordinator_address!r}: the port after '{LWS_CLUSTER}:' must be an "
                         f"integer in 1-65535 (or give '{LWS_CLUSTER}' alone for port {LWS_DEFAULT_PORT})")
    return int(port)


def lws_cluster(coordinator_address: str, env: Mapping[str, str]) -> tuple[str, int, int]:
    """(coordinator "host:port", num_processes, process_id) from LWS's variables in env, for an address lws_port
    accepts. A variable missing or malformed is a ValueError naming it."""
    port = lws_port(coordinator_address)
    if port is None:
        raise ValueError(f"coordinator_address {coordinator_address!r} is not '{LWS_CLUSTER}' or '{LWS_CLUSTER}:PORT'")
    host = _variable(env, LEADER_ADDRESS_ENV)
    if ":" in host:  # an IPv6 literal is bracketed in host:port; anything else with a colon carries a port
        try:
            host = f"[{ipaddress.IPv6Address(host.strip('[]'))}]"
        except ValueError:
            raise ValueError(f"{LEADER_ADDRESS_ENV} must be the leader's host name or address, without a port (the "
                             f"port is {LWS_CLUSTER}:PORT's), got {host!r}") from None
    size = _count(env, GROUP_SIZE_ENV, 1)
    index = _count(env, WORKER_INDEX_ENV, 0)
    if index >= size:
        raise ValueError(f"{WORKER_INDEX_ENV} must be in [0, {GROUP_SIZE_ENV} = {size}), got {index}")
    return f"{host}:{port}", size, index


def lws_bind_address(coordinator: str) -> str:
    """Where the leader's coordination service listens by default for lws_cluster's coordinator "host:port": the
    address itself if host is an address literal, every interface (JAX's "[::]:PORT") if it is a name (see the
    module's docstring)."""
    host, port = coordinator.rsplit(":", 1)
    try:
        ipaddress.ip_address(host.strip("[]"))
        return coordinator
    except ValueError:
        return f"[::]:{port}"


def _variable(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ValueError(f"--coordinator-address {LWS_CLUSTER} needs {name} (set by LeaderWorkerSet in every pod); "
                         f"{'not set' if name not in env else 'set but empty'}")
    return value


def _count(env: Mapping[str, str], name: str, low: int) -> int:
    value = _variable(env, name)
    if not _DIGITS.fullmatch(value) or int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)
