#!/usr/bin/env bash
# Serving against llama-server in one run: each server in turn on one port, nothing else running, the same
# closed-loop load (bench_serving.py) at each concurrency. One JSON per (server, concurrency) in OUT.
#
#   bash scripts/bench_serving_peers.sh OUT LLAMA_SERVER "1:12 16:64 64:192" NAME='serve flags' ...
#
# NAME=FLAGS runs `jaxserve serve FLAGS`; NAME=llama runs LLAMA_SERVER on $GGUF (the default model's) with
# $LLAMA_FLAGS (64 slots) and then FLAGS.
# CONCURRENCY:REQUESTS pairs say how many clients and how many measured requests; rRATE:REQUESTS sends them at
# Poisson arrival times instead (RATE requests/s), e.g. "r2:64 r4:128".
#   e.g. bash scripts/bench_serving_peers.sh /tmp/s /work/llama-server/build/bin/llama-server "16:64 64:192" \
#        f32='' int8='--quantization int8' bf16='--dtype bfloat16' llama=
set -euo pipefail
OUT=$1; LLAMA=$2; LOADS=$3; shift 3
PORT=${PORT:-8391}
GGUF=${GGUF:-$HOME/.cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_FLAGS=${LLAMA_FLAGS:--np 64 -c 65536 -t 2}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"

wait_ready() {  # the server lists its models once it has loaded and warmed up
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || { echo "server exited; see $2" >&2; return 1; }
    sleep 1
  done
  echo "server not ready after 600 s" >&2; return 1
}

for spec in "$@"; do
  name=${spec%%=*}; flags=${spec#*=}
  log="$OUT/$name.server.log"
  if [ "$name" = llama ]; then
    # shellcheck disable=SC2086
    "$LLAMA" -m "$GGUF" $LLAMA_FLAGS --port "$PORT" $flags > "$log" 2>&1 &
  else
    # shellcheck disable=SC2086  # FLAGS is a list of flags
    jaxserve serve --port "$PORT" $flags > "$log" 2>&1 &
  fi
  pid=$!
  wait_ready "$pid" "$log"
  metrics=(); [ "$name" = llama ] || metrics=(--server-metrics)
  for load in $LOADS; do
    c=${load%%:*}; n=${load#*:}
    if [ "${c#r}" != "$c" ]; then arrivals=(--request-rate "${c#r}"); else arrivals=(--concurrency "$c"); c=c$c; fi
    python "$HERE/bench_serving.py" --base-url "http://127.0.0.1:$PORT/v1" "${arrivals[@]}" --num-requests "$n" \
      --prompt-len 32 --output-len 64 --seed 0 "${metrics[@]}" --out "$OUT/${name}_$c.json" \
      | tail -n 3 | sed "s/^/[$name $c] /"
  done
  kill "$pid"; wait "$pid" 2> /dev/null || true
done
