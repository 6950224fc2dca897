"""The leader/follower protocol (`LeaderFollower`): how every process of a multi-process run takes part in the
collective phases only process 0 schedules.

The leader runs a collective phase (a warm-up, a generate call, a stream) and publishes a `StepMessage` before each
device step and an `EndMessage` or `ErrorMessage` when the phase is over; a follower runs the steps and returns the
leader's result or raises its error. `AbortMessage` ends every process (the leader failed a step it had published),
and `ShutdownMessage` ends a follower that follows until the leader is done (a server's). The messages go through a
`StepChannel` (jaxserve.multihost.channel).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import jax

from jaxserve.batch import StepInput
from jaxserve.multihost import process
from jaxserve.multihost.channel import StepChannel
from jaxserve.multihost.messages import AbortMessage, EndMessage, ErrorMessage, ShutdownMessage, StepMessage


class LeaderFollower:
    """The leader/follower protocol: how every process takes part in a collective phase (a warm-up, a generate
    call, a stream) that only the leader schedules.

    On the leader, `run(fn)` runs fn, which publishes each device step before it runs it (`lead_step`, or
    `publish_step` then the step), then publishes fn's result (EndMessage) or error (ErrorMessage). On a follower,
    `run(fn)` does not call fn: it runs the published steps as they come, each with `run_step(runner_index, batch)`
    (waited for: in step with the leader, not queued), and returns the leader's result or raises its error. A
    run() inside another's fn is part of the outer phase. `follow()` follows every phase until the leader's
    `shutdown()` (a server's followers). A step the leader fails after publishing it ends every process (`abort`).

    channel None (one process): run(fn) is fn(), a step is just run, and nothing is published.
    """

    def __init__(self, channel: StepChannel | None, is_leader: bool,
                 run_step: Callable[[int, StepInput], Any] | None = None):
        """run_step(runner_index, batch): runs a published step on this process's runner of that index and returns
        its output (the follower waits for it); needed on followers only."""
        self.channel = channel
        self._is_leader = is_leader
        self._run_step = run_step
        self._in_phase = False

    @classmethod
    def for_this_process(cls, run_step: Callable[[int, StepInput], Any] | None = None,
                         secret_file: str | None = None) -> "LeaderFollower":
        """After `initialize` (or in a single process): a channel over jax.distributed's coordination service if
        there are several processes, authenticated with shared_secret(secret_file)."""
        channel = StepChannel(process.shared_secret(secret_file)) if jax.process_count() > 1 else None
        return cls(channel, process.is_leader(), run_step)

    @property
    def is_leader(self) -> bool:
        """Process 0, which schedules (True in a single process)."""
        return self._is_leader

    @property
    def multi_process(self) -> bool:
        return self.channel is not None

    @property
    def is_follower(self) -> bool:
        """A process other than 0 of a multi-process run: it runs the leader's steps, never its own."""
        return self.channel is not None and not self._is_leader

    def run(self, fn: Callable[[], Any]):
        """fn's device work on every process: fn()'s result on every process (on followers, the leader's, received)
        or its error raised. One process: just fn()."""
        if self.channel is None or self._in_phase:  # one phase: a generate inside another's fn is part of it
            return fn()
        if not self._is_leader:
            return self._follow()
        self._in_phase = True
        try:
            result = fn()
        except BaseException as e:
            self.channel.send(ErrorMessage(e))
            raise
        finally:
            self._in_phase = False
        self.channel.send(EndMessage(result))
        return result

    def stream(self, pieces: Callable[[], Iterable[str]]) -> Iterator[str]:
        """A streaming phase: on the leader, yields what pieces() yields and, however the stream ends (finished,
        failed, or closed by its consumer), publishes those yielded as the phase's result (end_stream); on a
        follower, yields the leader's pieces once its stream is over. One process: pieces()."""
        if self.is_follower:
            yield from self._follow()
            return
        yielded = []
        try:
            for piece in pieces():
                yielded.append(piece)
                yield piece
        finally:
            self.end_stream(yielded)

    def end_stream(self, pieces: list[str]) -> None:
        """On the leader: a stream is over, with these text pieces (what a follower's stream yields). Nothing in a
        single process."""
        if self.channel is not None and self._is_leader:
            self.channel.send(EndMessage(pieces))

    def publish_step(self, runner_index: int, batch: StepInput) -> None:
        """On the leader, before it runs a step on its runner of this index: every follower runs it too. Nothing in
        a single process."""
        if self.channel is None:
            return
        if not self._is_leader:
            raise RuntimeError("a follower runs the leader's steps: it publishes none")
        self.channel.send(StepMessage(runner_index, batch))

    def lead_step(self, runner_index: int, batch: StepInput, run: Callable[[StepInput], Any]):
        """run(batch) on the leader, published first: its output. If it fails once published, every process ends
        (abort): the followers run it regardless, so no later step could line up."""
        if self.channel is None:
            return run(batch)
        self.publish_step(runner_index, batch)
        try:
            return run(batch)
        except BaseException as e:
            self.abort(f"process 0 failed a step it had sent to the other processes ({type(e).__name__}: {e})")

    def abort(self, reason: str) -> None:
        """On the leader, which failed a step it had published: tells the followers, and ends this process. Never
        returns."""
        if self.channel is None or not self._is_leader:
            raise RuntimeError("abort is for the leader of a multi-process run")
        self.channel.abort(reason)

    def follow(self) -> None:
        """On a follower: run the leader's steps until it shuts down (`jaxserve serve` on processes other than 0)."""
        if not self.is_follower:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        self._follow(until_shutdown=True)

    def _follow(self, until_shutdown: bool = False):
        """Runs the leader's steps as they come, to the end of its current phase (its result, or its error raised)
        or, until_shutdown, of all of them."""
        while True:
            message = self.channel.receive()
            if isinstance(message, StepMessage):
                jax.block_until_ready(self._run_step(message.runner_index, message.batch))
            elif isinstance(message, ShutdownMessage):
                return None
            elif isinstance(message, AbortMessage):  # the leader failed a step this process ran: out of step
                process.exit_now(1, f"jaxserve: error: {message.reason}")
            elif until_shutdown:
                continue
            elif isinstance(message, EndMessage):
                return message.result
            else:
                raise message.error

    def shutdown(self) -> None:
        """On the leader: tells the followers there are no more steps, and stops watching for stop requests.
        Nothing elsewhere."""
        if self.channel is not None and self._is_leader:
            self.channel.send(ShutdownMessage())
            self.channel.close()

    def request_stop(self) -> None:
        """On a follower (its SIGTERM): asks the leader to end the run."""
        self.channel.request_stop()

    def watch_stop_requests(self, on_request: Callable[[], None]) -> None:
        """On the leader: on_request() (on another thread) once a follower asks to stop, until shutdown()."""
        self.channel.watch_stop_requests(on_request)
