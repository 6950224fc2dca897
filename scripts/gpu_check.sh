#!/usr/bin/env bash
# The GPU checks and timings this repository wants, as one device-machine call (about 6-9 minutes on an H200).
# Nothing here has run on a GPU yet: read the first failure before tuning anything.
#
# Before the call, here (the device machine reaches no registry and lacks gguf):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl gguf
# Then: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600). Results come back under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # the package from this checkout, no install (no registry there)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# 1. The kernels compiled by Triton for real, against their references (the engine's start-up check), at every
#    family's heads (SmolLM2, Llama 3 8B, Gemma 3 1B's head_dim 256, Qwen3) and at a serving shape, float and int8
#    KV pages, with the block sizes gpu_blocks derives for the chip's shared memory.
python3 - <<'PY' 2>&1 | tee "$OUT/self_check.log"
import jax.numpy as jnp
from jaxserve.pallas_kernels.self_check import check_kernels
serving = dict(num_pages=4096, pages_per_seq=512, max_num_seqs=64, max_tokens=512)
for heads, kv_heads, head_dim in [(9, 3, 64), (32, 8, 128), (4, 1, 256), (40, 8, 128)]:
    for kv in ("auto", "int8"):
        problem = check_kernels("pallas-gpu", heads, kv_heads, head_dim, 16, jnp.bfloat16, None, serving,
                                kv_cache_dtype=kv)
        print(f"self-check heads {heads}/{kv_heads} d{head_dim} kv {kv}: {problem or 'ok'}")
PY

# 2. The int4 matmul kernel on the device against its reference.
python3 - <<'PY' 2>&1 | tee "$OUT/quantized_matmul_check.log"
import jax, jax.numpy as jnp, numpy as np
from jaxserve.pallas_kernels import quantized_matmul as qm
from jaxserve.model.quant import quantize_int4
rng = np.random.default_rng()
for M, K, N in [(1, 4096, 4096), (8, 4096, 14336), (32, 14336, 4096)]:
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.02, jnp.float32)
    q4 = quantize_int4(w, 32)
    for name, got, want in [
            ("int4", lambda: qm.int4_matmul(x, q4.packed, q4.scale, q4.offset, group_size=32),
             lambda: qm.int4_matmul_reference(x, q4.packed, q4.scale, q4.offset, group_size=32))]:
        try:
            g, r = np.asarray(got(), np.float32), np.asarray(want(), np.float32)
            print(f"{name} {M}x{K}x{N}: rel err {np.linalg.norm(g - r) / np.linalg.norm(r):.2e}")
        except Exception as e:
            print(f"{name} {M}x{K}x{N}: FAILED {type(e).__name__}: {str(e)[:300]}")
PY

# 3. Timings: the ragged attention kernel against XLA, the int4 kernel against XLA's int4 and int8 and bf16.
timeout 420 python3 scripts/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log" | tail -40

# 4. Flash-decoding: 1, 2 and 4 decode rows after 8k and 32k cached tokens, the kernel with its key splits
#    (gpu_blocks.key_splits) and unsplit, each against the oracle, timed (a CPU dry run: --smoke).
timeout 180 python3 scripts/bench_flash_decoding.py --out "$OUT/flash_decoding.json" 2>&1 | tee "$OUT/flash_decoding.log"
