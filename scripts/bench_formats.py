"""Which weight format XLA:CPU multiplies fastest, per matmul shape of the default model and per number of rows.

Formats: float32; bf16 weights with bf16 activations (float32 accumulation); int8 weights converted inside the dot
(weight-only, `quant._xla_matmul` for Int8Weight, what TPU and GPU run); int8 x int8 -> int32 with dynamic
per-row activation scales (w8a8, `quant.int8_dot_matmul(digits=1)`), and with the activations as two int8 digits
(int8x2, `quant.int8_dot_matmul`, what CPU runs for an int8 weight). Each also under oneDNN (`xla_cpu_use_onednn`,
passed as a per-program compiler option, so every variant runs in this one process).

Decode reads every weight from memory once a step, so one program holds `copies` distinct copies of a weight
(unrolled, no scan: a scan's dynamic slice copies the weight on XLA:CPU) adding up to about --bytes bytes: a single
weight would sit in cache and time the cache, not the weight read. Variants are interleaved (round r runs every
variant once) and the best of --rounds is kept: the machine is shared, and best-of is the least disturbed figure.

With --decode, also the engine's whole decode step at batch 1 and 64 for float32, int8 and int8 weight-only (one
LLM per format, timed in interleaved rounds).

  PYTHONPATH=$PWD python scripts/bench_formats.py [--rows 1,8,64,256,512] [--decode]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.model.quant import Int8Weight, int8_dot_matmul, quantize_int8  # noqa: E402

# SmolLM2-135M's matmuls [in, out]: q/o, k/v, gate/up, down, LM head.
SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (576, 192), "gate/up": (576, 1536),
          "down": (1536, 576), "lm_head": (576, 49152)}
FLAGS = {"default": {}, "onednn": {"xla_cpu_use_onednn": True}}


def formats(w32):
    """name -> (weight operand, x -> x @ w)."""
    q = quantize_int8(w32)
    wb = w32.astype(jnp.bfloat16)
    return {
        "float32": (w32, lambda x, w: x @ w),
        "bf16": (wb, lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)),
        "int8": (q, lambda x, w: (x @ w.values.astype(x.dtype)) * w.scale),
        "w8a8": (q, lambda x, w: int8_dot_matmul(x, w, digits=1)),
        "int8x2": (q, int8_dot_matmul),
    }


def nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def bench_matmuls(rows, rounds: int, target_bytes: int, flags):
    rng = np.random.default_rng(0)
    results = []
    for name, (k, n) in SHAPES.items():
        w32 = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02)
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            variants = {}
            for fmt, (w, fn) in formats(w32).items():
                copies = max(1, min(64, math.ceil(target_bytes / nbytes(w))))
                ws = [jax.tree_util.tree_map(jnp.copy, w)
                      for i in range(copies)]  # distinct buffers

                def many(x, ws, fn=fn):
                    return [fn(x, wi) for wi in ws]
                for flag in flags:
                    prog = jax.jit(many).lower(x, ws).compile(FLAGS[flag])
                    variants[(fmt, flag)] = (prog, ws, copies, nbytes(w))
            best = {key: float("inf") for key in variants}
            for _ in range(rounds):
                for key, (prog, ws, copies, _) in variants.items():
                    jax.block_until_ready(prog(x, ws))  # one warm call, so each timing starts equal
                    t = time.perf_counter()
                    jax.block_until_ready(prog(x, ws))
                    best[key] = min(best[key], (time.perf_counter() - t) / copies)
            f32 = best[("float32", "default")]
            for (fmt, flag), (_, _, copies, size) in variants.items():
                s = best[(fmt, flag)]
                results.append({"shape": name, "K": k, "N": n, "M": m, "format": fmt, "flags": flag,
                                "us": round(s * 1e6, 2), "GB_s": round(size / s / 1e9, 2),
                                "vs_float32": round(f32 / s, 2), "copies": copies})
            print(f"{name:14s} M={m:<4d} " + "  ".join(
                f"{fmt}/{flag}={best[(fmt, flag)] * 1e6:8.1f}us" for fmt, flag in variants), flush=True)
            del variants
    return results


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WeightOnlyInt8(Int8Weight):
    """An int8 weight that CPU multiplies as it did before int8_dot_matmul: converted to float inside the dot."""


def bench_decode(model, rounds: int, steps: int, batch_sizes=(1, 64)):
    """Engine decode step time per format (ms), the whole step (forward, sampling, host work). "int8-weight-only"
    is int8 as CPU ran it before int8_dot_matmul: that engine's Int8Weight nodes become WeightOnlyInt8, which
    quant's CPU branch (patched for this process) sends to the weight-only product."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.batching.sequence import Sequence
    from jaxserve.model import quant

    kinds = {"float32": {}, "int8": {"quantization": "int8"}, "int8-weight-only": {"quantization": "int8"}}
    llms = {fmt: LLM(model, max_model_len=512, max_num_seqs=max(batch_sizes), max_num_batched_tokens=256,
                     warmup=False, **kw) for fmt, kw in kinds.items()}
    runner = llms["int8-weight-only"].runner
    runner.params = jax.tree_util.tree_map(
        lambda n: WeightOnlyInt8(n.values, n.scale) if isinstance(n, Int8Weight) else n, runner.params,
        is_leaf=lambda n: isinstance(n, Int8Weight))
    cpu_matmul = quant._cpu_matmul
    quant._cpu_matmul = (lambda kernels, x, w: quant._xla_matmul(x, w) if isinstance(w, WeightOnlyInt8)
                         else cpu_matmul(kernels, x, w))

    def steps_of(fmt, n=1):
        for _ in range(n):
            llms[fmt].core.step()
    out = {}
    for b in batch_sizes:
        params = SamplingParams(temperature=0, max_tokens=steps * (rounds + 2) + 8, ignore_eos=True)
        for fmt, llm in llms.items():
            for i in range(b):
                llm.core.add(Sequence(f"{fmt}-{b}-{i}", 0, list(range(1, 33)), params, 0, llm.max_model_len, []))
            while any(s.num_to_compute > 1 for s in llm.scheduler.running) or llm.scheduler.waiting:
                steps_of(fmt)
            steps_of(fmt, 3)  # compile and settle this bucket
        best = {fmt: float("inf") for fmt in llms}
        for _ in range(rounds):
            for fmt in llms:
                t = time.perf_counter()
                steps_of(fmt, steps)
                best[fmt] = min(best[fmt], (time.perf_counter() - t) / steps)
        for fmt, llm in llms.items():
            for s in list(llm.scheduler.running):
                llm.core.abort(s.request_id)
            out.setdefault(fmt, {})[f"b{b}_step_ms"] = round(best[fmt] * 1e3, 2)
            out[fmt][f"b{b}_tok_s"] = round(b / best[fmt], 1)
        print(f"decode b{b}: " + "  ".join(f"{fmt}={best[fmt] * 1e3:.2f}ms" for fmt in llms), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,256,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bytes", type=float, default=64e6, help="weight bytes one timed program reads")
    ap.add_argument("--flags", default="default,onednn", help="comma list of " + ", ".join(FLAGS))
    ap.add_argument("--decode", action="store_true", help="also the engine's decode step, b1 and b64")
    ap.add_argument("--skip-matmuls", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "bench_results" / "formats.json"))
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "jax": jax.__version__,
               "cpu": os.uname().machine, "load_avg_at_start": os.getloadavg(),
               "method": "best of rounds, variants interleaved in one process; shared machine"}
    if not args.skip_matmuls:
        results["matmuls"] = bench_matmuls([int(r) for r in args.rows.split(",")], args.rounds, int(args.bytes),
                                           args.flags.split(","))
    if args.decode:
        results["decode"] = bench_decode(args.model, args.rounds, steps=16)
    results["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
