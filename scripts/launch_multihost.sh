#!/usr/bin/env bash
# Runs one jaxserve command as N processes on this machine, the way it runs on N hosts (development and tests):
#
#   scripts/launch_multihost.sh N [jaxserve args...]
#   scripts/launch_multihost.sh 2 serve --tensor-parallel-size 2 --port 8000
#
# Each process gets LOCAL_DEVICES CPU devices (default 1; gloo collectives between processes) and the same
# arguments plus --coordinator-address / --num-processes / --process-id. Process 0 prints and serves; the others
# follow it. The script exits once every process has ended, with process 0's status (or a follower's failure); if any
# process fails, the others end within the coordination service's heartbeat timeout (jaxserve.multihost).
set -uo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES COMMAND [jaxserve args...]" >&2
  exit 2
fi
N=$1
shift
PORT=${COORDINATOR_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${LOCAL_DEVICES:-1}"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# The processes' shared secret (jaxserve.multihost.process.shared_secret): a fresh one for this run unless given.
export JAXSERVE_COORDINATOR_SECRET=${JAXSERVE_COORDINATOR_SECRET:-$(python -c 'import secrets; print(secrets.token_hex(16))')}
pids=()
for ((i = 0; i < N; i++)); do
  jaxserve "$@" --coordinator-address "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i" &
  pids+=($!)
done
# A stop goes to process 0, which finishes its requests and tells the others there are no more steps.
trap 'kill -TERM "${pids[0]}" 2>/dev/null' INT TERM
while :; do
  wait "${pids[0]}"
  status=$?
  kill -0 "${pids[0]}" 2>/dev/null || break  # still there: the wait was cut short by a signal
done
for pid in "${pids[@]:1}"; do
  wait "$pid"
  follower=$?
  [[ $status -eq 0 ]] && status=$follower  # a clean run is one where every process ended cleanly
done
exit $status
