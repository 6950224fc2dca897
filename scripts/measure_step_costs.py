"""What one engine step costs on this machine, by its shape: the table scripts/simulate_pd.py builds steps from.

A step's time is modelled as the time of its token bucket with nothing cached (`base`: matmuls, the step's own
keys, the LM head, sampling) plus the cached keys its attention reads, in the two ways the XLA:CPU attention
(`jaxserve.model.attention.ragged_attention`) reads them (see `simulate_pd.attention_work`):
  - `group_reads`: the per-token groups, each walking the pages of its longest member for every member (decode
    rows: the step's rows bucket x the longest context);
  - `long_reads`: one long prompt chunk's cached pages, read once but scored against all T tokens of the step.
Seconds per read of each kind are fitted by least squares over decode steps (R rows at context C) and prompt chunks
after a cached prefix; a few mixed steps (decodes plus a chunk) are measured too and set against the model's
prediction, so the fit's error is in the JSON (`check`).

    nice python scripts/measure_step_costs.py [--out scripts/bench_results/step_costs_2core.json]
    taskset -c 0 nice python scripts/measure_step_costs.py --out scripts/bench_results/step_costs_1core.json
    python scripts/measure_step_costs.py --refit scripts/bench_results/step_costs_2core.json  # the fit again

Default model, float32, the engine's default limits (max_num_seqs 64, max_num_batched_tokens 512, pages of 16),
steps run through ModelRunner.dispatch/fetch as the engine runs them; each time is the fastest of --repeats.
Rows share a pool of pages (page ids cycle through it): timing depends on how many pages a step reads, not on
which, and 64 rows of 2k tokens would otherwise need 6 GB of float32 KV.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine  # noqa: E402
from simulate_pd import StepCosts, attention_work  # noqa: E402

from jaxserve.buckets import Buckets  # noqa: E402
from jaxserve.cache import pages_needed  # noqa: E402
from jaxserve.runner.batch_builder import Row  # noqa: E402
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402

PAGE = 16


def rows_for(decode: list[int], chunks: list[tuple[int, int]], pool: int, vocab: int) -> list[Row]:
    """decode: each decode row's cached tokens; chunks: (cached tokens, new tokens) of each prompt chunk. Page ids
    cycle through 1..pool-1 (0 is the scratch page)."""
    rng = np.random.default_rng(0)
    rows, next_page = [], 0

    def pages(n_tokens):
        nonlocal next_page
        n = pages_needed(n_tokens, PAGE)
        ids = [1 + (next_page + j) % (pool - 1) for j in range(n)]
        next_page += n
        return ids

    for i, ctx in enumerate(decode):
        rows.append(Row([int(rng.integers(100, vocab))], ctx, pages(ctx + 1), slot=i))
    for start, n in chunks:
        rows.append(Row(rng.integers(100, vocab, n).tolist(), start, pages(start + n), slot=len(rows)))
    return rows


def cases(max_seqs: int, token_buckets, contexts, starts) -> list[dict]:
    out = [{"kind": "base", "decode": [], "chunks": [[0, t]]} for t in token_buckets]
    for r in (1, 4, 8, 16, 32, max_seqs):
        out += [{"kind": "decode", "decode": [c] * r, "chunks": []} for c in contexts]
    big = token_buckets[-1]
    out += [{"kind": "chunk", "decode": [], "chunks": [[s, big]]} for s in starts]
    mid = contexts[len(contexts) // 2]
    for r in (16, max_seqs - 16):  # what the model is checked on: a colocated engine's mixed steps
        out.append({"kind": "mixed", "decode": [mid] * r, "chunks": [[starts[0], big - r]]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2560)
    ap.add_argument("--contexts", default="256,1024,2048", help="decode rows' cached tokens")
    ap.add_argument("--chunk-starts", default="512,1024,1536", help="cached tokens before a full-budget chunk")
    ap.add_argument("--pool-pages", type=int, default=1024, help="KV pages the rows' page ids cycle through")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: scripts/bench_results/step_costs_{N}core.json")
    ap.add_argument("--refit", default=None, metavar="JSON", help="fit an earlier run's points again, measure nothing")
    args = ap.parse_args()
    if args.refit:
        return refit(Path(args.refit))
    cores = len(os.sched_getaffinity(0))
    out = Path(args.out or Path(__file__).parent / "bench_results" / f"step_costs_{cores}core.json")
    model = load_model(None, jnp.float32)
    config = model.config
    buckets = Buckets.for_limits(args.max_num_seqs, args.max_num_batched_tokens,
                                 pages_needed(args.max_model_len, PAGE))
    runner = ModelRunner(config, model.params, RunnerConfig(jnp.float32, args.pool_pages, PAGE, buckets,
                                                            args.max_num_seqs))
    contexts = [int(x) for x in args.contexts.split(",")]
    starts = [int(x) for x in args.chunk_starts.split(",")]
    points = []
    t_all = time.perf_counter()
    for case in cases(args.max_num_seqs, buckets.num_tokens, contexts, starts):
        rows = rows_for(case["decode"], [tuple(c) for c in case["chunks"]], args.pool_pages, config.vocab_size)
        runner.fetch(runner.dispatch(rows))  # compiles the bucket the first time
        seconds = min(runner._time(rows) for _ in range(args.repeats))
        shape = attention_work(case["decode"], [tuple(c) for c in case["chunks"]], buckets.num_tokens,
                               args.max_num_seqs)
        points.append({**case, **shape, "seconds": round(seconds, 5)})
        print(f"{case['kind']:>7} rows {len(rows):>3} bucket {shape['bucket']:>4} "
              f"group reads {shape['group_reads']:>8} long reads {shape['long_reads']:>8}: {seconds * 1e3:8.1f} ms",
              flush=True)
    costs, check = fit(points, args.max_num_seqs)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "machine": machine(),
              "cores": cores, "loadavg_1m_after": round(os.getloadavg()[0], 2),
              "model": "default (SmolLM2-135M-Instruct)", "dtype": "float32", "page_size": PAGE,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "token_buckets": list(buckets.num_tokens), **costs.to_json(),
              "kv_bytes_per_token": int(2 * config.num_layers * config.num_kv_heads * config.head_dim * 4),
              "points": points, "check": check, "seconds_total": round(time.perf_counter() - t_all, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    report(costs, check)
    print(f"wrote {out}")


def fit(points: list[dict], max_num_seqs: int) -> tuple[StepCosts, list[dict]]:
    """The cost model from measured points: each bucket's base as measured (not capped by a bigger bucket's: until
    2026-12-02 steps of 64-256 tokens cost more than 512-token ones, the prompt scorer's head hoisted out of its
    loop, and a cap hid that), the two read costs by least squares, and each point's prediction against it."""
    base = {p["bucket"]: p["seconds"] for p in points if p["kind"] == "base"}
    reads = [p for p in points if p["kind"] in ("decode", "chunk")]
    a = np.array([[p["group_reads"], p["long_reads"]] for p in reads], float)
    b = np.array([p["seconds"] - base[p["bucket"]] for p in reads])
    (per_group_read, per_long_read), *_ = np.linalg.lstsq(a, b, rcond=None)
    costs = StepCosts(base, max(per_group_read, 0.0), max(per_long_read, 0.0), max_num_seqs)
    check = []
    for p in points:
        predicted = costs.seconds(p["decode"], [tuple(c) for c in p["chunks"]])
        check.append({"kind": p["kind"], "bucket": p["bucket"], "rows": len(p["decode"]) + len(p["chunks"]),
                      "measured_s": p["seconds"], "model_s": round(predicted, 5),
                      "error": round(predicted / p["seconds"] - 1, 3)})
    return costs, check


def refit(path: Path) -> None:
    """Fits an earlier run's points again (the model changed, the measurements did not)."""
    result = json.loads(path.read_text())
    costs, check = fit(result["points"], result["max_num_seqs"])
    result.pop("base_s_measured", None)
    result.update(costs.to_json(), check=check, refit=f"{time.strftime('%Y-%m-%d %H:%M')}: {' '.join(sys.argv)}")
    path.write_text(json.dumps(result, indent=1))
    report(costs, check)
    print(f"rewrote {path}")


def report(costs: StepCosts, check: list[dict]) -> None:
    print(f"\nbase s by bucket: {costs.base}\nper group read {costs.per_group_read:.3e} s, "
          f"per long read {costs.per_long_read:.3e} s")
    print(f"{'kind':>7}{'bucket':>7}{'rows':>5}{'measured ms':>12}{'model ms':>10}{'error':>7}")
    for c in check:
        print(f"{c['kind']:>7}{c['bucket']:>7}{c['rows']:>5}{c['measured_s'] * 1e3:>12.1f}{c['model_s'] * 1e3:>10.1f}"
              f"{c['error']:>7.0%}")


if __name__ == "__main__":
    main()
