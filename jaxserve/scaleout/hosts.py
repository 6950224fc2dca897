"""One jaxserve process per host on a Ray cluster: a placement group of one bundle per host (STRICT_SPREAD: no two on
one node), one actor in each bundle, each actor running one `jaxserve serve` process of a multi-process group
(--coordinator-address at process 0's node, --num-processes, --process-id; the shared secret in the environment).
Process 0 serves HTTP; the others follow its steps. One process or actor that ends ends them all, and the group says
which one it was.

    group = launch_hosts(2, ["--model", path, "--tensor-parallel-size", "8"], bundle={"TPU": 4})
    group.wait_ready()
    print(group.url)
    ended = group.wait()   # until one process ends; the others are stopped
"""
from __future__ import annotations

import dataclasses
import functools
import secrets

from jaxserve.scaleout import require_ray
from jaxserve.scaleout.child import ServeProcess, free_port

DEFAULT_BUNDLE = {"CPU": 1.0}
WILDCARDS = ("0.0.0.0", "::", "")


class HostProcess:
    """The actor in one bundle: where it runs, and its jaxserve process. Threaded (max_concurrency), so that stop()
    and wait_http() run while wait() blocks."""

    def __init__(self):
        self.server: ServeProcess | None = None

    def where(self) -> dict:
        ray = require_ray()
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "resources": context.get_assigned_resources()}

    def free_port(self) -> int:
        return free_port()

    def start(self, serve_args: list[str], env: dict[str, str], name: str) -> int:
        self.server = ServeProcess(serve_args, env, name)
        return self.server.pid

    def wait(self) -> tuple[int, str]:
        """The process's exit code and its last lines, once it ends."""
        return self.server.wait(), self.server.tail()

    def wait_http(self, url: str, timeout_s: float) -> None:
        self.server.wait_http(url, timeout_s)

    def stop(self, grace_s: float) -> int | None:
        return None if self.server is None else self.server.stop(grace_s)


@functools.lru_cache(maxsize=None)
def host_actor():
    """HostProcess as a Ray actor class (made on first use: this module imports without Ray)."""
    return require_ray().remote(max_concurrency=4)(HostProcess)


@dataclasses.dataclass(frozen=True)
class Host:
    process_id: int
    node_id: str
    node_ip: str
    resources: dict  # what Ray assigned the actor: its bundle's resources


@dataclasses.dataclass(frozen=True)
class Ended:
    """Why a group ended: the first of its processes to end (or whose actor died), and how."""
    process_id: int
    node_id: str
    returncode: int | None  # None: the actor itself died (killed, or its node lost)
    log_tail: str

    def __str__(self) -> str:
        how = ("its Ray actor died" if self.returncode is None else f"it exited with code {self.returncode}")
        return f"jaxserve process {self.process_id} (node {self.node_id}) ended first: {how}; the others were stopped"


def actor_options(bundle: dict) -> dict:
    """The options that put an actor in a bundle of these resources (it asks for exactly the bundle: an actor asks
    for one CPU by default, which a bundle of accelerators alone does not have)."""
    other = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": other,
            **({"memory": bundle["memory"]} if "memory" in bundle else {})}


def http_address(serve_args: list[str], num_hosts: int) -> tuple[str, int]:
    """--host and --port of `jaxserve serve` with these flags (the parser's defaults, its checks: a bad flag is a
    ValueError here, before any process starts)."""
    from jaxserve.cli.parser import build_parser
    try:
        args = build_parser().parse_args(["serve", *serve_args])
    except SystemExit:  # argparse has printed why
        raise ValueError(f"not flags of `jaxserve serve`: {' '.join(serve_args)}") from None
    for flag in ("coordinator_address", "process_id"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is set by the Ray launcher: do not give it")
    if args.num_processes not in (None, num_hosts):
        raise ValueError(f"--num-processes {args.num_processes} but {num_hosts} hosts: give it as num_hosts only")
    if args.distributed_executor_backend == "ray":
        raise ValueError("the processes placed on Ray are launched by it: not with --distributed-executor-backend ray")
    return args.host, args.port


def launch_hosts(num_hosts: int, serve_args: list[str], bundle: dict | None = None, *, secret: str | None = None,
                 env: dict[str, str] | None = None, coordinator_port: int | None = None,
                 placement_timeout_s: float = 300.0) -> HostGroup:
    """Starts `jaxserve serve SERVE_ARGS` as one group of num_hosts processes, one per Ray node.

    bundle: the resources each process's bundle (and actor) holds, e.g. {"TPU": 4} (a host's chips), {"GPU": 8},
    {"CPU": 1} (the default); STRICT_SPREAD puts each bundle on a node of its own. secret: the processes' shared
    secret (16+ bytes; default: a fresh one). env: more environment for every process (Ray already sets the devices
    it assigned). coordinator_port: process 0's coordination service port (default: a free one on its node).
    Connects to Ray as ray.init() does if no connection is made yet. Returns once every process is started; its
    wait_ready() waits for the HTTP server."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    host, port = http_address(serve_args, num_hosts)
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from jaxserve.multihost.process import SECRET_ENV
    bundle = dict(bundle or DEFAULT_BUNDLE)
    group = placement_group([bundle] * num_hosts, strategy="STRICT_SPREAD")
    if not ray.wait([group.ready()], timeout=placement_timeout_s)[0]:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {num_hosts} bundles of {bundle}, each on a node of its own, within "
                           f"{placement_timeout_s:.0f} s (the cluster has {ray.cluster_resources()})")
    actors = [host_actor().options(**actor_options(bundle), scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote() for i in range(num_hosts)]
    try:
        hosts = [Host(i, w["node_id"], w["node_ip"], w["resources"])
                 for i, w in enumerate(ray.get([a.where.remote() for a in actors]))]
        leader_ip = hosts[0].node_ip
        coordinator = f"{_bracketed(leader_ip)}:{coordinator_port or ray.get(actors[0].free_port.remote())}"
        env = {**(env or {}), SECRET_ENV: secret or secrets.token_hex(16)}
        ray.get([a.start.remote([*serve_args, "--coordinator-address", coordinator, "--num-processes",
                                 str(num_hosts), "--process-id", str(i)], env, f"jaxserve process {i}")
                 for i, a in enumerate(actors)])
    except BaseException:
        for actor in actors:  # their processes end with them
            ray.kill(actor)
        remove_placement_group(group)
        raise
    url_host = leader_ip if host in WILDCARDS else host
    health_host = "127.0.0.1" if host in WILDCARDS else host  # asked by process 0's actor, on its own node
    return HostGroup(group, actors, hosts, f"http://{_bracketed(url_host)}:{port}",
                     f"http://{_bracketed(health_host)}:{port}/health")


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


class HostGroup:
    """The processes of one group, their actors and placement group. url: process 0's HTTP server. hosts: where each
    process runs. ended: why the group ended (None while it runs)."""

    def __init__(self, placement, actors, hosts: list[Host], url: str, health_url: str):
        self._placement, self._actors, self.hosts, self.url = placement, actors, hosts, url
        self._health_url = health_url
        self._exits = {a.wait.remote(): i for i, a in enumerate(actors)}
        self._stopped = False
        self.ended: Ended | None = None

    @property
    def actors(self) -> list:
        return list(self._actors)

    def wait_ready(self, timeout_s: float = 600.0, cancelled=lambda: False) -> bool:
        """Until process 0 serves (/health answers 200): True. RuntimeError if a process ends first (the others are
        then stopped) or timeout_s passes (the group is stopped). False as soon as cancelled() is true (asked every
        second; the group still runs)."""
        ray = require_ray()
        ready = self._actors[0].wait_http.remote(self._health_url, timeout_s)
        while not (found := ray.wait([ready, *self._exits], num_returns=1, timeout=1.0)[0]):
            if cancelled():
                return False
        done = found[0]
        if done is not ready:
            ended = self._end(done)
            raise RuntimeError(f"the group ended before it served: {ended}\n{ended.log_tail}")
        try:
            ray.get(ready)
        except ray.exceptions.RayError as e:
            self.stop()
            raise RuntimeError(f"process 0 did not serve: {e}") from None
        return True

    def wait(self, timeout_s: float | None = None) -> Ended | None:
        """Until one process ends (or its actor dies): the others are stopped, and the first is returned. None if
        timeout_s passes first (the group still runs)."""
        done = require_ray().wait(list(self._exits), num_returns=1, timeout=timeout_s)[0]
        return self._end(done[0]) if done else None

    def _end(self, ref) -> Ended:
        ray = require_ray()
        i = self._exits[ref]
        try:
            code, tail = ray.get(ref)
        except ray.exceptions.RayActorError:
            code, tail = None, ""
        self.ended = Ended(i, self.hosts[i].node_id, code, tail)
        self.stop()
        return self.ended

    def stop(self, grace_s: float = 30.0) -> None:
        """Every process stopped (SIGTERM: process 0 drains; SIGKILL after grace_s), the actors and the placement
        group released. Safe to call again."""
        if self._stopped:
            return
        self._stopped = True
        ray = require_ray()
        from ray.util.placement_group import remove_placement_group
        # Process 0 first: it ends the followers' steps itself; a follower stopped first would end the group with
        # an error.
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(grace_s), timeout=grace_s + 10)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # gone already, or stuck: ray.kill below ends it and, with it, its process
        for actor in self._actors:
            ray.kill(actor)
        remove_placement_group(self._placement)
