"""One engine over several processes (JAX's multi-controller runtime, `jax.distributed`).

Every process runs the same step programs on the same global batch, each computing on its own devices' shards.
Process 0 (the leader) owns the scheduler, the tokenizer and the HTTP server; it publishes each step's batch, and
the others (followers) run what it published, in order. One module a concept:

- `process`: starting the processes (`initialize`, which holds an early SIGTERM for `take_held_sigterm`), the
  secret they share (`shared_secret`), `is_leader`, and failures bounded by the coordination service's heartbeats
  (`exit_now`);
- `cluster_env`: the processes from a cluster manager's environment (`--coordinator-address lws`: Kubernetes
  LeaderWorkerSet's LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX);
- `messages`: what the leader sends (`StepMessage`, `EndMessage`, `ErrorMessage`, `AbortMessage`,
  `ShutdownMessage`);
- `wire`: a message as authenticated bytes, data only, never code (`encode`, `decode`, `MessageRefused`);
- `channel`: `StepChannel`, the messages in order through the coordination service's key-value store, its flow
  control (KEEP_MESSAGES) and the run's id every value it writes is signed for;
- `leader_follower`: `LeaderFollower`, the protocol every process follows.

The public names are re-exported here. Module settings are read where they are defined, so set or patch them there
(`multihost.channel.KEEP_MESSAGES`, `multihost.process.exit_now`), never on this package.
"""
from jaxserve.multihost.channel import StepChannel, ack_every
from jaxserve.multihost.leader_follower import LeaderFollower
from jaxserve.multihost.messages import AbortMessage, EndMessage, ErrorMessage, Message, ShutdownMessage, StepMessage
from jaxserve.multihost.process import (
                                         HEARTBEAT_TIMEOUT_S,
                                         MIN_SECRET_BYTES,
                                         SECRET_ENV,
                                         SHUTDOWN_TIMEOUT_S,
                                         exit_now,
                                         initialize,
                                         is_leader,
                                         shared_secret,
                                         take_held_sigterm,
)
from jaxserve.multihost.wire import MessageRefused, decode, encode

__all__ = ["AbortMessage", "EndMessage", "ErrorMessage", "HEARTBEAT_TIMEOUT_S", "LeaderFollower", "MIN_SECRET_BYTES",
           "Message", "MessageRefused", "SECRET_ENV", "SHUTDOWN_TIMEOUT_S", "ShutdownMessage", "StepChannel",
           "StepMessage", "ack_every", "decode", "encode", "exit_now", "initialize", "is_leader", "shared_secret",
           "take_held_sigterm"]
