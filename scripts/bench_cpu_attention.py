"""The CPU paged-attention kernel alone, as a 64-row decode step calls it: one call per layer over that layer's own
pages (the default model's shapes: 3 KV heads, 3 queries each, head_dim 64; 30 layers' K and V, 755 MB in bf16, more
than the caches hold), float32 pages, bf16 pages widened to float32, and bf16 pages with bf16 dots (where the CPU
has AVX-512-BF16), interleaved in one process (medians of --repeats).

    python scripts/bench_cpu_attention.py [--rows 64] [--context 512] [--order in-order|scattered] [--repeats 15]
                                          [--out bench_results/cpu_attention.json]

`scattered`: each row's pages anywhere in the cache (a long-running server's), `in-order`: one after another (a
fresh cache's). GB/s is the K and V bytes read over the time: the bound is the rate the cores read memory.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine  # noqa: E402

from jaxserve.cpu_kernels import paged_attention  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, LAYERS = 3, 3, 64, 16, 30


def layer_pages(num_pages: int, bf16: bool) -> list:
    """Each layer's K (and, shifted, V) pages [num_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM]: float32 or bf16 bits."""
    key = jax.random.PRNGKey(0)
    pages = []
    for layer in range(LAYERS):
        p = jax.random.normal(jax.random.fold_in(key, layer), (num_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM))
        pages.append(jax.lax.bitcast_convert_type(p.astype(jnp.bfloat16), jnp.uint16) if bf16 else p)
    return pages


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--order", choices=("in-order", "scattered"), default="in-order")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench_results/cpu_attention.json")
    args = ap.parse_args()
    rows, context = args.rows, args.context
    per_row = -(-context // PAGE_SIZE)
    num_pages = rows * per_row + 8
    rng = np.random.default_rng(0)
    ids = np.arange(rows * per_row) if args.order == "in-order" else rng.permutation(num_pages)[:rows * per_row]
    table = jnp.asarray(ids.reshape(rows, per_row).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((rows, KV_HEADS, GROUP, HEAD_DIM)) * HEAD_DIM ** -0.5, jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, KV_HEADS, HEAD_DIM)), jnp.float32)
    row, pos = jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), context, jnp.int32)

    def step(bf16_dots):  # one call per layer, each on the last one's output (a chain, as the layers are)
        def run(q, k_pages, v_pages):
            for kp, vp in zip(k_pages, v_pages):
                q = q + 0.01 * paged_attention.paged_attention(q, k, k, row, pos, pos, table, kp, vp,
                                                               bf16_dots=bf16_dots)
            return q
        return jax.jit(run)

    f32 = layer_pages(num_pages, False)
    bf16 = layer_pages(num_pages, True)
    kinds = {"float32": (step(False), f32), "bf16 widened": (step(False), bf16), "bf16 dots": (step(True), bf16)}
    shifted = {id(p): [jnp.roll(x, 1, axis=0) for x in p] for p in (f32, bf16)}  # V: other pages than K's
    runs: dict = {name: [] for name in kinds}
    for fn, pages in kinds.values():
        jax.block_until_ready(fn(q, pages, shifted[id(pages)]))
    for _ in range(args.repeats):
        for name, (fn, pages) in kinds.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(q, pages, shifted[id(pages)]))
            runs[name].append(time.perf_counter() - t)
    results = []
    print(f"{'pages':<14}{'ms (30 layers)':>16}{'MB read':>10}{'GB/s':>8}")
    for name, times in runs.items():
        ms = statistics.median(times) * 1e3
        mb = LAYERS * rows * context * KV_HEADS * HEAD_DIM * 2 * (4 if name == "float32" else 2) / 1e6
        results.append({"pages": name, "ms": round(ms, 2), "mb": round(mb, 1), "gb_per_s": round(mb / ms, 2)})
        print(f"{name:<14}{ms:>16.1f}{mb:>10.0f}{mb / ms:>8.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "rows": rows,
                               "context": context, "order": args.order, "repeats": args.repeats,
                               "results": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
