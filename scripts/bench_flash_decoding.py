"""GPU flash-decoding: a few decode rows over long contexts, the Pallas kernel with its rows' cached keys split over
programs (`gpu_blocks.key_splits`) against the same kernel unsplit and against the oracle.

    python scripts/bench_flash_decoding.py [--out bench_results/flash_decoding.json]   # GPU (scripts/gpu_check.sh)
    python scripts/bench_flash_decoding.py --smoke     # short contexts, the kernel interpreted: a CPU check

1, 2 and 4 decode rows (one new token each) after 8k and 32k cached tokens, at Llama 3 8B's heads (bench_kernels'
ragged_step: 32 query heads on 8 KV heads of 128, pages of 16, bf16, pages shuffled). Per case: the splits the
kernel takes, the largest error of the split and the unsplit kernel against `ragged_attention_reference`, their
times (median of 10 after a warm-up) and bandwidth (the cached K and V the step must read / time) beside the
device's copy bandwidth measured in the same run. Without splits such a step is 8-32 programs on a 132-SM chip.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_kernels as bk  # noqa: E402

from jaxserve.model.attention import ragged_attention_reference  # noqa: E402
from jaxserve.pallas_kernels import BLOCK_SIZES, ragged_kernel_for  # noqa: E402
from jaxserve.pallas_kernels.gpu_blocks import HOPPER_SHARED_MEMORY, gpu_blocks, key_splits  # noqa: E402
from jaxserve.pallas_kernels.query_blocks import num_slots  # noqa: E402
from jaxserve.pallas_kernels.softmax import pow2  # noqa: E402


def splits_of(target: str, q, k_pages, rows) -> int:
    """The key splits `ragged_attention_gpu` takes for this step with `target`'s block sizes (its own rule)."""
    sizes = BLOCK_SIZES[target]
    T, H, _ = q.shape
    _, kv_heads, page_size, D = k_pages.shape
    S, P = rows.page_table.shape
    shared_memory = sizes.get("shared_memory", HOPPER_SHARED_MEMORY)
    derived = gpu_blocks(T, S, H // kv_heads, D, page_size, q.dtype.itemsize, shared_memory, sizes["block_q"])
    block_pages = min(sizes.get("block_pages") or derived.block_pages, pow2(P))
    return key_splits(num_slots(T, S, derived.block_q) * kv_heads, P, block_pages, sizes["cores"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="short contexts, interpreted (checks the script on CPU)")
    ap.add_argument("--out", default="bench_results/flash_decoding.json")
    args = ap.parse_args()
    device = jax.devices()[0]
    if args.smoke:
        bk.REPEATS, target, dtype, contexts, tol = 1, "gpu-interpret", jnp.float32, (256,), 1e-4
    elif device.platform == "gpu":
        target, dtype, contexts, tol = "gpu", jnp.bfloat16, (8192, 32768), 2e-2
    else:
        raise SystemExit(f"a GPU kernel: run it on a GPU (or --smoke), not on {device.platform}")
    split = jax.jit(ragged_kernel_for("pallas-" + target))
    unsplit = jax.jit(lambda *a: ragged_kernel_for("pallas-" + target)(*a, num_splits=1))
    oracle = jax.jit(ragged_attention_reference)
    copy = bk.copy_bandwidth(8 << 20 if args.smoke else 2 << 30)
    results = {"date": time.strftime("%Y-%m-%d"), "device": str(device.device_kind), "jax": jax.__version__,
               "copy_GBps": round(copy, 1), "cases": []}
    print(f"{device.device_kind}: copy bandwidth {copy:.0f} GB/s")
    print(f"{'decode rows x context':<24}{'splits':>7}{'split ms':>10}{'GB/s':>7}{'unsplit ms':>12}{'GB/s':>7}"
          f"{'max err':>10}  vs oracle")
    for context in contexts:
        for batch in (1, 2, 4):
            step = bk.ragged_step([(context, 1)] * batch, dtype)
            q, k_pages, rows = step[0], step[3], step[5]
            n_bytes = 2 * batch * context * k_pages.shape[1] * k_pages.shape[3] * jnp.dtype(dtype).itemsize
            want = np.asarray(oracle(*step), np.float32)
            r = {"rows": batch, "context": context, "splits": splits_of(target, q, k_pages, rows), "kv_bytes": n_bytes}
            for name, fn in (("split", split), ("unsplit", unsplit)):
                r[f"{name}_max_err"] = float(np.abs(np.asarray(fn(*step), np.float32) - want).max())
                t = bk.timed(fn, *step)
                r[f"{name}_ms"], r[f"{name}_GBps"] = round(t * 1e3, 3), round(n_bytes / t / 1e9, 1)
            err = max(r["split_max_err"], r["unsplit_max_err"])
            r["agrees"] = err <= tol
            results["cases"].append(r)
            print(f"  {batch} x {context:<18}{r['splits']:>7}{r['split_ms']:>10.3f}{r['split_GBps']:>7.0f}"
                  f"{r['unsplit_ms']:>12.3f}{r['unsplit_GBps']:>7.0f}{err:>10.2e}  "
                  f"{'ok' if r['agrees'] else 'DISAGREES'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    if not all(r["agrees"] for r in results["cases"]):
        raise SystemExit("the kernel disagrees with the oracle")


if __name__ == "__main__":
    main()
