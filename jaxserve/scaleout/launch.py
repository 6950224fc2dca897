"""`jaxserve serve --distributed-executor-backend ray --num-processes N ...`, run on a Ray cluster's head (as vLLM's
`vllm serve --distributed-executor-backend ray`): the same command placed as N processes, one per node
(hosts.launch_hosts), process 0's URL printed; it runs until a process ends (then the others are stopped and the one
that ended is named: a non-zero exit) or until Ctrl-C / SIGTERM (every process stopped: process 0 drains)."""
from __future__ import annotations

import signal
import sys
import threading

from jaxserve.cli_flags import json_object_flag
from jaxserve.scaleout import require_ray
from jaxserve.scaleout.hosts import launch_hosts


def ray_bundle(text: str | None) -> dict | None:
    """--ray-bundle's JSON object of resource amounts (None: the default bundle)."""
    if text is None:
        return None
    bundle = json_object_flag("--ray-bundle", text, '{"TPU": 4}')
    if not (bundle and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in bundle.values())):
        raise ValueError(f"--ray-bundle must map resource names to amounts > 0, such as '{{\"TPU\": 4}}'; got {text}")
    return bundle


def process_args(argv: list[str]) -> list[str]:
    """Each placed process's `jaxserve serve` flags: the command's own, its backend overridden (argparse keeps a
    flag's last value), so that a process is one of the group rather than another launcher."""
    return [*argv[argv.index("serve") + 1:], "--distributed-executor-backend", "external_launcher"]


def serve_on_ray(args, argv: list[str]) -> None:
    if args.num_processes is None or args.num_processes < 1:
        raise ValueError("--distributed-executor-backend ray places --num-processes processes, one per Ray node: "
                         "give --num-processes (the number of hosts)")
    for flag in ("coordinator_address", "process_id"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--distributed-executor-backend ray sets --{flag.replace('_', '-')} itself")
    bundle = ray_bundle(args.ray_bundle)
    ray = require_ray()
    if not ray.is_initialized():
        ray.init()  # RAY_ADDRESS, else the cluster this node belongs to (`ray start`), else a local one
    group = launch_hosts(args.num_processes, process_args(argv), bundle)
    # SIGTERM is noted, not raised: an exception thrown into Ray's own calls can leave its client stuck.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if not group.wait_ready(cancelled=stop.is_set):
            return  # SIGTERM while it started
        nodes = ", ".join(f"{h.process_id}: {h.node_ip} ({h.node_id[:8]})" for h in group.hosts)
        print(f"jaxserve: serving at {group.url} (processes on nodes {nodes})", flush=True)
        ended = None
        while ended is None and not stop.is_set():
            ended = group.wait(timeout_s=1.0)
    finally:
        group.stop(args.shutdown_grace_period)
    if ended is None:
        return  # SIGTERM: the group stopped as `jaxserve serve` stops (process 0 drains), a clean end
    if ended.process_id == 0 and ended.returncode == 0:
        return  # process 0 was stopped on its own node and drained: a clean end
    print(ended.log_tail, file=sys.stderr, end="")
    raise RuntimeError(str(ended))
