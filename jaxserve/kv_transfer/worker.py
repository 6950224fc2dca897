"""The thread a decode server's KV imports are prepared on: checksums, digests and the host-to-device staging of
fetched pages, off the engine thread and at a lower CPU priority than it.

Why a thread of its own, and why lower: a decode server pinned to one core shares it between its engine (its steps'
XLA threads and the host work between them) and whatever else the process runs. A checksum of a 60 MB transfer on a
thread of equal priority takes half the core for as long as it runs, stretching every step it overlaps by as much
(issue 53: the decode server's TPOT P95 was 3.5x its P50). At a lower priority it runs in the time the steps leave
(between them, while the engine waits for requests) and takes only a small share while a step runs: the steps keep
their pace, and an import lands a little later. One thread: imports are prepared one at a time, in order, so a burst
never holds several transfers' buffers half-checked at once.

On Linux a thread's nice value is its own (setpriority on its thread id); elsewhere the thread keeps the process's
priority, and the work is still off the engine thread.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading

NICE_INCREMENT = 10  # CFS weight 110 against the engine's 1024: ~10% of a core contended, all of it idle

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def lower_priority() -> bool:
    """Lowers the calling thread's CPU priority by NICE_INCREMENT (Linux: per thread); whether it could."""
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE_INCREMENT))
        return True
    return False


def import_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's KV import thread (made on first use), for `loop.run_in_executor`."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-import",
                                                              initializer=lower_priority)
        return _executor
