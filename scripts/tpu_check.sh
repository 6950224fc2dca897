#!/usr/bin/env bash
# The TPU twin of scripts/gpu_check.sh: on the day a TPU is lent, one call that checks the Mosaic ragged kernel
# against its reference at every family's heads, over head-major pages padded to 128 lanes as the engine stores
# them (the engine's start-up check, serving shape compiled), then times the kernels against XLA. Nothing here has
# run on a TPU yet: read the first failure before tuning anything.
#   bash scripts/tpu_check.sh        # results under $OUT (default bench_results)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 -c "import jax; print(jax.devices())" | tee "$OUT/tpu.txt"

python3 - <<'PY' 2>&1 | tee "$OUT/self_check_tpu.log"
import jax.numpy as jnp
from jaxserve.pallas_kernels.self_check import check_kernels
serving = dict(num_pages=8192, pages_per_seq=512, max_num_seqs=64, max_tokens=512)
for heads, kv_heads, head_dim, window in [(9, 3, 64, None), (32, 8, 128, None), (4, 1, 256, 512), (40, 8, 128, None)]:
    for kv in ("auto", "int8"):
        problem = check_kernels("pallas-tpu", heads, kv_heads, head_dim, 16, jnp.bfloat16, window, serving,
                                kv_cache_dtype=kv)
        print(f"self-check heads {heads}/{kv_heads} d{head_dim} window {window} kv {kv}: {problem or 'ok'}")
PY

timeout 420 python3 scripts/bench_kernels.py --out "$OUT/kernels_tpu.json" 2>&1 | tee "$OUT/bench_kernels_tpu.log" | tail -40
