"""The threads that compile grammars: a few long-lived threads with a large stack.

llguidance's grammar compiler recurses on the calling thread's stack, once per level of a `$ref` chain or a chain
of Lark rules, and overflowing it is a segfault that takes the whole process down: on a default 8 MiB stack a
2,500-deep `$ref` chain or a 2,700-rule chain is enough (both fit in a 100 kB spec). `grammar.MAX_DEPTH` refuses
specs that deep before they reach llguidance; these threads' STACK_BYTES are the second line, with room for
about thirty times more than that bound (every spec under the size cap was compiled on them, however deep).

`threading.stack_size` is process-wide: it is set only while one of these threads starts, under a lock, and put
back at once (a thread another part of the process starts in that instant gets the large stack too, which costs it
address space only: stack pages are committed as they are touched).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading

STACK_BYTES = 256 * 2**20
WORKERS = max(2, min(8, os.cpu_count() or 2))  # compiles release the GIL: a few run at once

log = logging.getLogger(__name__)
_stack_lock = threading.Lock()  # one thread start at a time changes the process's stack size
_pool_lock = threading.Lock()
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_threads: list[threading.Thread] = []


def run(fn, *args):
    """fn(*args) on a compile thread: its result, or what it raised. Blocks the caller until it is done."""
    _start_workers()
    future: concurrent.futures.Future = concurrent.futures.Future()
    _jobs.put((future, fn, args))
    return future.result()


def start_with_stack(thread: threading.Thread, stack_bytes: int) -> None:
    """Starts `thread` with a stack of `stack_bytes`, leaving the process's setting for other threads as it was.
    Falls back to the default stack where the platform refuses the size or the memory (grammar.MAX_DEPTH still
    keeps compiles within that)."""
    with _stack_lock:
        try:
            old = threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError) as e:  # a size the platform does not take
            log.warning("grammar compile threads run on the default stack: %s", e)
            thread.start()
            return
        try:
            thread.start()
        except RuntimeError as e:  # no memory for a stack that large ("can't start new thread")
            log.warning("grammar compile threads run on the default stack: %s", e)
            threading.stack_size(old)
            thread.start()
        finally:
            threading.stack_size(old)


def _start_workers() -> None:
    with _pool_lock:
        while len(_threads) < WORKERS:
            thread = threading.Thread(target=_work, name=f"grammar-compile-{len(_threads)}", daemon=True)
            start_with_stack(thread, STACK_BYTES)
            _threads.append(thread)


def _work() -> None:
    while True:
        future, fn, args = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
            future.set_exception(e)
        del future, fn, args  # hold nothing of a finished job while waiting for the next
