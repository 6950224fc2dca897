"""The values engine options may take, and the defaults more than one layer needs.

A leaf: it imports nothing of jaxserve. `EngineConfig` checks options against these; the code that implements an
option (the scheduler, the engine, the weight loaders, the attention dispatch, the multi-host start) imports its
values from here too, so the config never imports the engine and the engine never defines what the config checks.
"""
from __future__ import annotations

# Parameter and activation dtypes; "auto" is float32 on CPU, bfloat16 on GPU/TPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Waiting sequences in arrival order, or lowest `priority` first (a better one may preempt a worse one).
SCHEDULING_POLICIES = ("fcfs", "priority")

# An engine's part in disaggregated prefill: everything, prompts only (each sequence handed off after its first
# token), or sequences prefilled elsewhere (see jaxserve.batching.scheduler).
ROLES = ("both", "prefill", "decode")

# What one may ask `attention_backend` for (see jaxserve.model.attention.resolve_attention_backend).
ATTENTION_BACKENDS = ("auto", "reference", "dense", "pallas", "pallas-gpu", "pallas-tpu")

# The KV-cache budget where a device states no memory limit (CPU), unless kv_cache_memory_bytes says otherwise.
CPU_KV_CACHE_BYTES = 2 << 30

# coordinator_address for JAX's own cluster detection (TPU pod slices, SLURM).
AUTO_CLUSTER = "auto"
# coordinator_address ("lws" or "lws:PORT") for the processes of a Kubernetes LeaderWorkerSet group, read from the
# variables it sets in every pod (see jaxserve.multihost.cluster_env), and the coordinator's port where none is given
# (older JAX's for TPU pod slices, which TPU recipes on LeaderWorkerSet use).
LWS_CLUSTER = "lws"
LWS_DEFAULT_PORT = 8476


# The checks EngineConfig (and the options defined beside the code that implements them) run on a value.
def check_int(name: str, value, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")


def check_type(name: str, value, kind: type, optional: bool = False) -> None:
    if not (isinstance(value, kind) or (optional and value is None)):
        raise TypeError(f"{name} must be a {kind.__name__}{' or None' if optional else ''}, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
