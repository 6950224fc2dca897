"""The Pallas kernels against their XLA references at serving sizes, with achieved bandwidth and FLOP/s.

    python scripts/bench_kernels.py [--out bench_results/kernels.json]     # on a GPU or TPU
    python scripts/bench_kernels.py --smoke                                # tiny sizes, both kernel sets
                                                                           # interpreted: a CPU check

Paged decode: 8 KV heads, 32 query heads, head dim 128, bfloat16, page size 16, one query per sequence, every
sequence at the full context. Bytes = the K and V a step must read (batch x context x 8 x 128 x 2 x 2 B); achieved
bandwidth = bytes / time, against the device's copy bandwidth measured in the same run (a large array copy).
Flash prefill: one causal prompt of T tokens, same heads; FLOPs = 2 x 2 x H x T^2 x D / 2 (causal half).
The XLA references materialise what the kernels avoid (every page gathered; the full score matrix), so at the
largest sizes they may run out of memory: that is recorded, not raised. Times: median of 10 after a warm-up.
Quantized matmul (GPU only): x [M, K] bfloat16 times int8 / int4 (groups of --group-size) weights [K, N], the kernels
that dequantize in registers against XLA's `(x @ values.astype(x.dtype)) * scale` and dequantize-then-matmul, and a
bfloat16 matmul of the same shape; bandwidth = the weight bytes (values and scales) / time.
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

from jaxserve.attention import resolve_attention_backend
from jaxserve.pallas_kernels import (flash_attention_reference, int4_matmul, int8_matmul, kernels_for,
                                     paged_attention_reference)
from jaxserve.pallas_kernels.quantized_matmul import int4_dequantize, int4_matmul_reference, int8_matmul_reference

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


def bench_paged(batch, context, dtype, paged):
    rng = np.random.default_rng(0)
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq + 1
    k_pages = jnp.asarray(rng.standard_normal((num_pages, PAGE, KVH, D), np.float32), dtype)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, PAGE, KVH, D), np.float32), dtype)
    table = jnp.asarray(1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, H, D), np.float32), dtype)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    pos = jnp.full((batch, 1), context, jnp.int32)
    kernel = jax.jit(paged)
    reference = jax.jit(paged_attention_reference)
    args = (q, k_pages, v_pages, table, kv_lens, pos)
    got, want = kernel(*args), reference(*args)
    err = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32))))
    t_kernel, kernel_error = try_time(kernel, *args)
    t_ref, ref_error = try_time(reference, *args)
    n_bytes = 2 * batch * context * KVH * D * jnp.dtype(dtype).itemsize
    return {"batch": batch, "context": context, "kv_bytes": n_bytes, "max_abs_err": err,
            "kernel_ms": t_kernel and round(t_kernel * 1e3, 3), "xla_ms": t_ref and round(t_ref * 1e3, 3),
            "kernel_GBps": t_kernel and round(n_bytes / t_kernel / 1e9, 1),
            "xla_GBps": t_ref and round(n_bytes / t_ref / 1e9, 1), "errors": [kernel_error, ref_error]}


def bench_flash(tokens, dtype, flash):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, tokens, H, D), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((1, tokens, KVH, D), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((1, tokens, KVH, D), np.float32), dtype)
    zero, n = jnp.zeros(1, jnp.int32), jnp.full((1,), tokens, jnp.int32)
    kernel = jax.jit(flash)
    reference = jax.jit(flash_attention_reference)
    args = (q, k, v, zero, zero, n, n)
    t_kernel, kernel_error = try_time(kernel, *args)
    t_ref, ref_error = try_time(reference, *args)
    err = None
    if kernel_error is None and ref_error is None:
        err = float(jnp.max(jnp.abs(kernel(*args)[0].astype(jnp.float32) - reference(*args)[0].astype(jnp.float32))))
    flops = 2 * 2 * H * tokens * tokens * D / 2
    return {"tokens": tokens, "max_abs_err": err, "kernel_ms": t_kernel and round(t_kernel * 1e3, 3),
            "xla_ms": t_ref and round(t_ref * 1e3, 3), "kernel_TFLOPs": t_kernel and round(flops / t_kernel / 1e12, 1),
            "xla_TFLOPs": t_ref and round(flops / t_ref / 1e12, 1), "errors": [kernel_error, ref_error]}


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
        "int8": (jax.jit(lambda *a: int8_matmul(*a, interpret=interpret)), int8_args, K * N + 4 * N),
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
    # The kernels against their references, relative to the output's largest value.
    for name, fn, want_fn, args in [("int8", fns["int8"][0], int8_matmul_reference, int8_args),
                                    ("int4", fns["int4"][0], functools.partial(int4_matmul_reference,
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
    if args.smoke:
        backends, dtype = ["pallas-gpu-interpret", "pallas-tpu-interpret"], jnp.float32
        paged_cases, flash_cases = [(2, 64)], [48]
        quant_cases, quant_interpret = [(1, 256, 128), (8, 256, 128)], True
    else:
        if device.platform not in ("gpu", "tpu"):
            raise SystemExit("the kernels compile for GPU and TPU only (use --smoke on CPU)")
        backends, dtype = [resolve_attention_backend("pallas")], jnp.bfloat16
        paged_cases = [(1, 2048), (1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 2048), (256, 2048),
                       (32, 32768)]
        flash_cases = [1024, 2048, 8192, 16384, 32768]
        quant_cases = [(M, K, N) for K, N in [(4096, 4096), (4096, 14336), (14336, 4096)] for M in (1, 8, 32)]
        quant_cases = quant_cases if device.platform == "gpu" else []  # the kernels are written for GPU only
        quant_interpret = False
    results = {"date": time.strftime("%Y-%m-%d"), "device": str(device.device_kind), "jax": jax.__version__,
               "copy_GBps": round(copy_bandwidth(8 << 20 if args.smoke else 2 << 30), 1), "paged": [], "flash": [],
               "quantized": []}
    print(f"{device.device_kind}: copy bandwidth {results['copy_GBps']} GB/s")
    for backend in backends:
        paged, flash = kernels_for(backend)
        print(f"{backend + ' paged decode':<34}{'kernel ms':>11}{'GB/s':>8}{'% peak':>8}{'XLA ms':>10}{'GB/s':>8}")
        for batch, context in paged_cases:
            r = {"backend": backend, **bench_paged(batch, context, dtype, paged)}
            results["paged"].append(r)
            share = r["kernel_GBps"] and 100 * r["kernel_GBps"] / results["copy_GBps"]
            print(f"  b{batch:<4} ctx {context:<23}{r['kernel_ms'] or float('nan'):>11.3f}{r['kernel_GBps'] or 0:>8.0f}"
                  f"{share or 0:>7.0f}%{r['xla_ms'] or float('nan'):>10.3f}{r['xla_GBps'] or 0:>8.0f}")
        print(f"{backend + ' flash prefill':<34}{'kernel ms':>11}{'TFLOP/s':>8}{'XLA ms':>10}{'TFLOP/s':>8}")
        for tokens in flash_cases:
            r = {"backend": backend, **bench_flash(tokens, dtype, flash)}
            results["flash"].append(r)
            print(f"  T {tokens:<31}{r['kernel_ms'] or float('nan'):>11.3f}{r['kernel_TFLOPs'] or 0:>8.1f}"
                  f"{r['xla_ms'] or float('nan'):>10.3f}{r['xla_TFLOPs'] or 0:>8.1f}")
    if quant_cases:
        print(f"{'quantized matmul, int4 g' + str(args.group_size):<28}"
              + "".join(f"{name + ' us':>12}{'GB/s':>7}" for name in ("int8", "int8 XLA", "int4", "int4 XLA", "bf16")))
    for M, K, N in quant_cases:
        r = bench_quantized(M, K, N, args.group_size, dtype, quant_interpret)
        results["quantized"].append(r)
        print(f"  M {M:<3} {K:>5} x {N:<12}" + "".join(
            f"{r[name + '_us'] or float('nan'):>12.1f}{r[name + '_GBps'] or 0:>7.0f}"
            for name in ("int8", "int8_xla", "int4", "int4_xla", "bf16")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
