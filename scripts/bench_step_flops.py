"""The 64-row decode step against what its products' FLOPs allow on this CPU (issue 53).

Measures, interleaved in one process (float32 and bfloat16 alternately, medians of --repeats):
  - the CPU's matmul peak: a large square jnp.dot (--peak-n, default 2048) per dtype, GFLOP/s;
  - each of the default model's 64-row products alone (the fused q/k/v, o, the fused gate/up, down, and the LM
    head), XLA's dot at the step's shapes, and its share of that peak;
  - the whole 64-row decode step (Steps.step: forward, cache write, sampling; --context cached tokens a row), its
    forward alone, and the forward without attention, against 2 x (its weights' elements) x 64 FLOPs at the peak.

    python scripts/bench_step_flops.py [--rows 64] [--context 512] [--repeats 7] [--out bench_results/step_flops.json]

On a shared machine only the ratios inside one run mean anything (the step's ms over the peak's floor).
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
from profile_step import case_rows  # noqa: E402

from jaxserve.cache import init_kv_cache, pages_needed  # noqa: E402
from jaxserve.cache.kv_cache import bf16_pages_as_bits  # noqa: E402
from jaxserve.model import attention as attention_module  # noqa: E402
from jaxserve.model.decoder import DecoderModel  # noqa: E402
from jaxserve.runner.batch_builder import build_batch  # noqa: E402
from jaxserve.runner.model_runner import served_params  # noqa: E402
from jaxserve.runner.steps import Steps  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def interleaved(fns: dict, repeats: int) -> dict:
    """Median ms of each fn, run in turn (a, b, a, b, ...) after one call each that compiles it."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    runs: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            runs[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in runs.items()}


def products(config, rows: int) -> dict:
    """The step's dots: name -> (in, out, count per step)."""
    h, f = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    n = config.num_layers
    return {"qkv (fused)": (h, qkv, n), "o": (config.num_heads * config.head_dim, h, n),
            "gate/up (fused)": (h, 2 * f, n), "down": (f, h, n), "LM head": (h, config.vocab_size, 1)}


def step_program(model, dtype, rows: int, context: int, page_size: int = 16):
    """(the whole step, the forward without attention) as callables on device inputs; the step's matmul FLOPs."""
    config = model.config
    params = served_params(config, jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                                else x, model.params), "cpu")
    batch_rows = case_rows(f"b{rows}", context, page_size, config.vocab_size)
    pages = pages_needed(context + 1, page_size)
    batch = build_batch(batch_rows, page_size, config.vocab_size, rows, rows, pages)
    device_batch = jax.block_until_ready(jax.device_put(batch))
    kv = init_kv_cache(config, 1 + rows * pages, page_size, dtype,
                       bf16_as_bits=bf16_pages_as_bits("cpu", "reference"))
    steps = Steps(config, dtype)
    steps.put_batch(batch)
    state = {"kv": kv, "last": jnp.zeros(rows + 1, jnp.int32)}

    def whole():
        o, state["kv"], state["last"] = steps.step(params, state["kv"], state["last"], device_batch)
        return o.tokens

    forward = jax.jit(lambda p, kv, b: DecoderModel(config, dtype).apply(p, b.token_ids, kv, b.rows,
                                                                      b.logits_index)[0])
    real = attention_module.ragged_attention
    attention_module.ragged_attention = lambda q, k, v, *a, **kw: q  # shapes kept, no attention work
    try:
        no_attention = jax.jit(lambda p, kv, b: DecoderModel(config, dtype).apply(p, b.token_ids, kv, b.rows,
                                                                                   b.logits_index)[0])
        no_attention.lower(params, state["kv"], device_batch).compile()
    finally:
        attention_module.ragged_attention = real
    flops = 2 * rows * sum(i * o * n for i, o, n in products(config, rows).values())
    return (whole, lambda: forward(params, state["kv"], device_batch),
            lambda: no_attention(params, state["kv"], device_batch), flops)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_results/step_flops.json")
    args = ap.parse_args()
    model = load_model(args.model, jnp.float32)
    config, rng, R = model.config, np.random.default_rng(0), args.rows
    fns, flops = {}, {}
    n = args.peak_n
    for name, dt in DTYPES.items():
        a = jnp.asarray(rng.normal(size=(n, n)), dt)
        dot = jax.jit(jnp.dot)
        fns[f"peak {name}"] = (lambda a=a, dot=dot: dot(a, a))
        flops[f"peak {name}"] = 2 * n ** 3
        for pname, (i, o, _) in products(config, R).items():
            x, w = jnp.asarray(rng.normal(size=(R, i)), dt), jnp.asarray(rng.normal(size=(i, o)) * 0.05, dt)
            fns[f"{pname} {name}"] = (lambda x=x, w=w, dot=dot: dot(x, w))
            flops[f"{pname} {name}"] = 2 * R * i * o
        whole, forward, no_attention, f = step_program(model, dt, R, args.context)
        fns[f"step {name}"], fns[f"step forward {name}"] = whole, forward
        fns[f"step forward without attention {name}"] = no_attention
        for k in ("step", "step forward", "step forward without attention"):
            flops[f"{k} {name}"] = f
    ms = interleaved(fns, args.repeats)
    table = []
    print(f"{'program':<42}{'ms':>10}{'GFLOP/s':>10}{'of peak':>9}{'ms/token':>10}{'peak floor':>11}")
    for key, t in ms.items():
        dtype = key.rsplit(" ", 1)[1]
        peak = flops[f"peak {dtype}"] / ms[f"peak {dtype}"] / 1e6  # GFLOP/s
        rate = flops[key] / t / 1e6
        floor = flops[key] / peak / 1e6  # ms at the peak
        row = {"program": key, "ms": round(t, 3), "gflops": round(rate, 1), "of_peak": round(rate / peak, 3),
               "floor_ms": round(floor, 3)}
        table.append(row)
        per_token = f"{t / R:>10.2f}" if key.startswith("step") else f"{'':>10}"
        print(f"{key:<42}{t:>10.2f}{rate:>10.1f}{rate / peak:>9.1%}{per_token}{floor:>11.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "rows": R,
                               "context": args.context, "peak_n": n, "repeats": args.repeats, "results": table},
                              indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
