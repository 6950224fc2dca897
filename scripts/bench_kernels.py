"""Ragged attention and the quantized matmuls at serving sizes, with achieved bandwidth.

    python scripts/bench_kernels.py [--out bench_results/kernels.json]     # GPU / TPU: the Pallas kernel too
    python scripts/bench_kernels.py --smoke                                # tiny sizes, the GPU kernel
                                                                           # interpreted: a CPU check

Ragged attention: 8 KV heads, 32 query heads, head dim 128, page size 16, one step of T tokens: decode rows
(one new token after `context` cached ones), a prompt chunk after `context` cached tokens, or both. Timed: the
oracle (`ragged_attention_reference`, which gathers every page of every token's row), the blocked jnp version
(`ragged_attention`, the CPU path) and, on a GPU or TPU, the Pallas kernel; errors against the oracle. Bytes = the
cached K and V the step must read; achieved bandwidth = bytes / time, against the device's copy bandwidth measured
in the same run (a large array copy). The oracle may run out of memory at the largest sizes: that is recorded, not
raised. Times: median of 10 after a warm-up.
Quantized matmul (GPU only): x [M, K] bfloat16 times int8 / int4 (groups of --group-size) weights [K, N]: XLA's int8
`(x @ values.astype(x.dtype)) * scale` (what `jaxserve.model.quant.matmul` runs for int8: XLA keeps the weight s8 into
its dot), the int4 kernel that dequantizes in registers against XLA's dequantize-then-matmul, and a bfloat16 matmul of
the same shape; bandwidth = the weight bytes (values and scales) / time.
"""
import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_cache import stored_head_dim
from jaxserve.model.attention import ragged_attention, ragged_attention_reference, resolve_attention_backend
from jaxserve.pallas_kernels import int4_matmul, page_head_dim_multiple, ragged_kernel_for
from jaxserve.pallas_kernels.quantized_matmul import int4_dequantize, int4_matmul_reference
from jaxserve.runner.batch_builder import Row, build_batch

KVH, H, D, PAGE = 8, 32, 128, 16
REPEATS = 10  # --smoke: 1


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def copy_bandwidth(n_bytes=2 << 30):
    x = jnp.ones(n_bytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1)  # reads and writes every byte once
    return 2 * n_bytes / timed(f, x) / 1e9


def try_time(fn, *args):
    try:
        return timed(fn, *args), None
    except Exception as e:  # noqa: BLE001 - recorded: the reference is expected to run out of memory at scale
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def ragged_step(rows, dtype):
    """The attention inputs of one step: rows [(cached tokens, new tokens)], random K/V in shuffled pages."""
    rng = np.random.default_rng(0)
    pages = [-(-(c + n) // PAGE) for c, n in rows]
    num_pages = sum(pages) + 1
    free = iter(1 + rng.permutation(num_pages - 1))
    batch = build_batch([Row([0] * n, c, [int(next(free)) for _ in range(p)]) for (c, n), p in zip(rows, pages)],
                        PAGE, 2, sum(n for _, n in rows), len(rows), max(pages))
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)  # noqa: E731
    T = batch.num_tokens
    # as the engine stores them
    stored = stored_head_dim(D, page_head_dim_multiple(resolve_attention_backend("pallas")))
    return (normal(T, H, D), normal(T, KVH, D), normal(T, KVH, D), normal(num_pages, KVH, PAGE, stored),
            normal(num_pages, KVH, PAGE, stored), jax.tree.map(jnp.asarray, batch.rows))


def bench_attention(name, rows, dtype, fns):
    args = ragged_step(rows, dtype)
    want = None
    r = {"case": name, "errors": {}}
    for impl, fn in fns.items():
        t, error = try_time(fn, *args)
        r[f"{impl}_ms"] = t and round(t * 1e3, 3)
        if error:
            r["errors"][impl] = error
            continue
        got = np.asarray(fn(*args), np.float32)
        want = got if want is None else want  # the first implementation is the oracle
        r[f"{impl}_err"] = float(np.abs(got - want).max())
    n_bytes = 2 * sum(c for c, _ in rows) * KVH * args[3].shape[-1] * jnp.dtype(dtype).itemsize  # pages as stored
    r["kv_bytes"] = n_bytes
    kernel_t = r.get("kernel_ms")
    r["kernel_GBps"] = kernel_t and round(n_bytes / kernel_t / 1e6, 1)
    r["max_abs_err"] = max((v for k, v in r.items() if k.endswith("_err")), default=None)
    return r


def bench_quantized(M, K, N, group_size, dtype, interpret):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K), np.float32), dtype)
    values = jnp.asarray(rng.integers(-127, 128, (K, N), dtype=np.int8))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, N) / 127, jnp.float32)
    packed = jnp.asarray(rng.integers(0, 256, (K // 2, N), dtype=np.uint8))
    g_scale = jnp.asarray(rng.uniform(0.5, 2.0, (K // group_size, N)) / 15, jnp.float16)
    g_offset = jnp.asarray(rng.uniform(-1.0, 0.0, (K // group_size, N)), jnp.float16)
    dense = jnp.asarray(rng.standard_normal((K, N), np.float32) * 0.02, dtype)
    int8_args, int4_args = (x, values, scale), (x, packed, g_scale, g_offset)
    fns = {  # name: (function, arguments, weight bytes)
        "int8_xla": (jax.jit(lambda x, v, s: ((x @ v.astype(x.dtype)) * s).astype(x.dtype)), int8_args,
                     K * N + 4 * N),
        "int4": (jax.jit(lambda *a: int4_matmul(*a, group_size=group_size, interpret=interpret)), int4_args,
                 K * N // 2 + 4 * (K // group_size) * N),
        "int4_xla": (jax.jit(lambda x, *w: x @ int4_dequantize(*w, group_size, x.dtype)), int4_args,
                     K * N // 2 + 4 * (K // group_size) * N),
        "bf16": (jax.jit(lambda x, w: x @ w), (x, dense), K * N * jnp.dtype(dtype).itemsize),
    }
    r = {"M": M, "K": K, "N": N, "group_size": group_size, "errors": {}}
    for name, (fn, args, n_bytes) in fns.items():
        t, error = try_time(fn, *args)
        r[f"{name}_us"] = t and round(t * 1e6, 1)
        r[f"{name}_GBps"] = t and round(n_bytes / t / 1e9, 1)
        if error:
            r["errors"][name] = error
    # The kernel against its reference, relative to the output's largest value.
    for name, fn, want_fn, args in [("int4", fns["int4"][0], functools.partial(int4_matmul_reference,
                                                                               group_size=group_size), int4_args)]:
        try:
            got, want = np.asarray(fn(*args), np.float32), np.asarray(want_fn(*args), np.float32)
            r[f"{name}_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        except Exception as e:  # noqa: BLE001 - recorded like the timings
            r["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (checks the script on CPU)")
    ap.add_argument("--out", default="bench_results/kernels.json")
    ap.add_argument("--group-size", type=int, default=32, help="int4 group size of the quantized matmul (32, 64, 128)")
    args = ap.parse_args()
    global REPEATS
    REPEATS = 1 if args.smoke else REPEATS
    device = jax.devices()[0]
    fns = {"reference": jax.jit(ragged_attention_reference), "blocked": jax.jit(ragged_attention)}
    if args.smoke:
        dtype = jnp.float32
        fns["kernel"] = jax.jit(ragged_kernel_for("pallas-gpu-interpret"))
        attention_cases = {"decode b2 ctx 64": [(64, 1)] * 2, "chunk 24 after 40": [(40, 24)],
                           "mixed": [(64, 1), (30, 1), (16, 20)]}
        quant_cases, quant_interpret = [(1, 256, 128), (8, 256, 128)], True
    else:
        dtype = jnp.bfloat16
        if device.platform in ("gpu", "tpu"):
            fns["kernel"] = jax.jit(ragged_kernel_for(resolve_attention_backend("pallas")))
        attention_cases = {f"decode b{b} ctx {c}": [(c, 1)] * b for b, c in [(1, 8192), (32, 2048), (64, 4096),
                                                                             (256, 2048)]}
        attention_cases |= {f"chunk {n} after {c}": [(c, n)] for c, n in [(0, 2048), (8192, 512)]}
        attention_cases["mixed 63 decodes ctx 2048 + chunk 256"] = [(2048, 1)] * 63 + [(1024, 256)]
        quant_cases = [(M, K, N) for K, N in [(4096, 4096), (4096, 14336), (14336, 4096)] for M in (1, 8, 32)]
        quant_cases = quant_cases if device.platform == "gpu" else []  # the kernels are written for GPU only
        quant_interpret = False
    results = {"date": time.strftime("%Y-%m-%d"), "device": str(device.device_kind), "jax": jax.__version__,
               "copy_GBps": round(copy_bandwidth(8 << 20 if args.smoke else 2 << 30), 1), "attention": [],
               "quantized": []}
    print(f"{device.device_kind}: copy bandwidth {results['copy_GBps']} GB/s")
    print(f"{'ragged attention':<40}" + "".join(f"{impl + ' ms':>14}" for impl in fns) + f"{'kernel GB/s':>13}")
    for name, rows in attention_cases.items():
        r = bench_attention(name, rows, dtype, fns)
        results["attention"].append(r)
        print(f"  {name:<38}" + "".join(f"{r[impl + '_ms'] or float('nan'):>14.3f}" for impl in fns)
              + f"{r['kernel_GBps'] or 0:>13.0f}")
    if quant_cases:
        print(f"{'quantized matmul, int4 g' + str(args.group_size):<28}"
              + "".join(f"{name + ' us':>12}{'GB/s':>7}" for name in ("int8 XLA", "int4", "int4 XLA", "bf16")))
    for M, K, N in quant_cases:
        r = bench_quantized(M, K, N, args.group_size, dtype, quant_interpret)
        results["quantized"].append(r)
        print(f"  M {M:<3} {K:>5} x {N:<12}" + "".join(
            f"{r[name + '_us'] or float('nan'):>12.1f}{r[name + '_GBps'] or 0:>7.0f}"
            for name in ("int8_xla", "int4", "int4_xla", "bf16")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
