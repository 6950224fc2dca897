"""What the leader sends its followers (see jaxserve.multihost.leader_follower for the protocol).

A `StepMessage` before each device step of a collective phase, and an `EndMessage` or `ErrorMessage` when the phase
is over; `AbortMessage` ends every process (the leader failed a step it had published), and `ShutdownMessage` ends a
follower that follows until the leader is done (a server's). jaxserve.multihost.wire makes them bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Union

from jaxserve.batch import StepInput


@dataclasses.dataclass(frozen=True, eq=False)  # eq: a batch's arrays have no truth value
class StepMessage:
    """Run this device step: the batch the leader's runner number `runner_index` (in the order every process builds
    its runners) runs next."""
    runner_index: int
    batch: StepInput
    kind: ClassVar[str] = "step"


@dataclasses.dataclass(frozen=True)
class EndMessage:
    """A collective phase is over and returned `result`: a list of RequestOutputs (generate), of text pieces
    (stream), or JSON-able plain data (warm-up's None, a benchmark's figures)."""
    result: Any
    kind: ClassVar[str] = "end"


@dataclasses.dataclass(frozen=True)
class ErrorMessage:
    """A collective phase failed on the leader with `error`; followers raise it (a type they do not know as a
    RuntimeError naming it)."""
    error: BaseException
    kind: ClassVar[str] = "error"


@dataclasses.dataclass(frozen=True)
class AbortMessage:
    """The processes can no longer stay in step (the leader failed a step it had published): every one ends."""
    reason: str
    kind: ClassVar[str] = "abort"


@dataclasses.dataclass(frozen=True)
class ShutdownMessage:
    """No more steps: a follower following until shutdown returns."""
    kind: ClassVar[str] = "shutdown"


Message = Union[StepMessage, EndMessage, ErrorMessage, AbortMessage, ShutdownMessage]
