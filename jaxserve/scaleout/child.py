"""`jaxserve serve` as a child process of a Ray actor: started with the actor's environment (the devices Ray gave it:
CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS) plus the caller's, its output kept (a tail, for the report of why it ended)
and passed on to the actor's log, ended with the actor even when the actor is killed outright."""
from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PR_SET_PDEATHSIG = 1  # linux/prctl.h
TAIL_LINES = 40


def free_port() -> int:
    """A TCP port free on this host now (the caller binds it soon after; another process could take it first)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it ends. A Ray actor killed with ray.kill
    (or lost with its node) runs no clean-up of its own, and a server left behind would hold the devices the actor's
    replacement is given. SIGKILL rather than SIGTERM: no one is left to read what a drain would finish."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class ServeProcess:
    """One `python -m jaxserve.cli serve ARGS` process.

    It is started by a thread of its own that lives until the process's output ends: the parent-death signal follows
    the thread that forked, and the thread a Ray actor's method runs on may end before the process should."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None, name: str = "jaxserve"):
        self.argv = [sys.executable, "-m", "jaxserve.cli", "serve", *serve_args]
        self._env = {**os.environ, **(env or {})}
        self._name = name
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.proc: subprocess.Popen | None = None
        threading.Thread(target=self._run, name=f"{name}-output", daemon=True).start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            self.proc = subprocess.Popen(self.argv, env=self._env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, errors="replace",
                                         preexec_fn=_die_with_parent)
        except OSError as e:
            self._error = e
            return
        finally:
            self._started.set()
        for line in self.proc.stdout:
            self._tail.append(line)
            sys.stderr.write(f"({self._name}) {line}")
        self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self) -> str:
        """The last lines the process wrote (stdout and stderr together)."""
        return "".join(self._tail)

    def wait(self, timeout_s: float | None = None) -> int:
        return self.proc.wait(timeout_s)

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until GET url answers 200 (the server is up); RuntimeError if the process ends or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while self.returncode is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self._name}: {url} did not answer 200 within {timeout_s:.0f} s")
            time.sleep(0.5)
        raise RuntimeError(f"{self._name} exited with code {self.returncode} before serving:\n{self.tail()}")

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM (the server drains its requests for its own grace period), then SIGKILL after grace_s."""
        if self.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
