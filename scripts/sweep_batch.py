"""The central trade-off of serving, on your machine and model: throughput against latency as max_num_seqs grows.

    python scripts/sweep_batch.py [--batch-sizes 1,2,4,8,16,32,64] [--num-requests 48] [--request-rate inf]
                                  [--ttft-slo 20] [--tpot-slo 0.15] [--out bench_results/sweep.json]

For each max_num_seqs the same seeded requests (scripts/workload.py) are served by the engine loop, arriving as a
Poisson process at --request-rate (inf: all at once, the offline case). Reported per point: output tokens/s, and
TTFT (from arrival, so it includes queueing) and TPOT at P50/P95/P99. Goodput = requests per second that met both
SLOs. The plot draws throughput against TPOT P50, one point per batch size, and marks
  - the knee: the last batch size whose doubling still bought >= 10% more throughput (beyond it TPOT keeps
    rising for little gain), and
  - the best point under the SLOs (highest goodput).
Up to 256 is allowed; on CPU the larger sizes take minutes each.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine  # noqa: E402
from workload import describe, percentiles, synth_requests  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def serve(llm: LLM, reqs) -> list[tuple[float, float, float]]:
    """Feeds requests to the engine loop at their arrival times; returns (arrival, first token, finish) each."""
    llm.reset_prefix_cache()
    core = llm.core
    seqs, nxt = [], 0
    t0 = time.monotonic()
    while nxt < len(reqs) or core.has_unfinished():
        now = time.monotonic() - t0
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            (seq,) = llm._request({"prompt_token_ids": r.prompt_token_ids},
                                  SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)).seqs
            seq.arrival_time = t0 + r.arrival
            core.add(seq)
            seqs.append(seq)
            nxt += 1
        if core.has_unfinished():
            core.step()
        else:
            time.sleep(max(0.0, reqs[nxt].arrival - (time.monotonic() - t0)))
    return [(s.arrival_time - t0, s.first_token_time - t0, s.finish_time - t0) for s in seqs]


def point(batch, reqs, times, seconds, ttft_slo, tpot_slo) -> dict:
    ttft = [f - a for a, f, _ in times]
    tpot = [(d - f) / (r.max_tokens - 1) for (_, f, d), r in zip(times, reqs) if r.max_tokens > 1]
    good = sum(t <= ttft_slo and (r.max_tokens == 1 or (d - f) / (r.max_tokens - 1) <= tpot_slo)
               for t, (_, f, d), r in zip(ttft, times, reqs))
    return {"max_num_seqs": batch, "seconds": round(seconds, 2),
            "output_tok_s": round(sum(r.max_tokens for r in reqs) / seconds, 1),
            "requests_per_s": round(len(reqs) / seconds, 3), "goodput_req_s": round(good / seconds, 3),
            "slo_met": good, "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot)}


def knee(points) -> int:
    for a, b in zip(points, points[1:]):
        if b["output_tok_s"] < 1.1 * a["output_tok_s"]:
            return a["max_num_seqs"]
    return points[-1]["max_num_seqs"]


def plot(points, knee_b, best_b, args, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [p["tpot_s"]["p50"] * 1e3 for p in points]
    y = [p["output_tok_s"] for p in points]
    ax.plot(x, y, "o-", color="C0")
    for p, xi, yi in zip(points, x, y):
        ax.annotate(f"{p['max_num_seqs']}", (xi, yi), textcoords="offset points", xytext=(5, -12))
    for b, style, label in [(knee_b, "s", "knee"), (best_b, "*", "best goodput under SLOs")]:
        i = [p["max_num_seqs"] for p in points].index(b)
        ax.plot(x[i], y[i], style, markersize=16, mfc="none", label=f"{label} (max_num_seqs={b})")
    ax.axvline(args.tpot_slo * 1e3, color="grey", ls="--", lw=0.8, label=f"TPOT SLO {args.tpot_slo * 1e3:.0f} ms")
    ax.set_xlabel("TPOT P50 (ms)")
    ax.set_ylabel("output tokens / s")
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate} req/s"
    ax.set_title(f"Throughput vs TPOT by max_num_seqs ({args.num_requests} requests, {rate})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--ttft-slo", type=float, default=20.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.15, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_results/sweep.json")
    args = ap.parse_args()
    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    if not 1 <= sizes[0] <= sizes[-1] <= 256:
        raise SystemExit("batch sizes must be in 1..256")
    # One engine for every point, compiled once for the largest; each point lowers its sequence cap.
    llm = LLM(max_model_len=1024, max_num_seqs=sizes[-1],
              max_num_batched_tokens=max(args.max_num_batched_tokens, sizes[-1]))
    reqs = synth_requests(args.num_requests, args.seed, vocab=llm.config.vocab_size, request_rate=args.request_rate)
    points = []
    print(f"{'max_num_seqs':>12}{'out tok/s':>11}{'goodput':>9}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}")
    for b in sizes:
        llm.scheduler.max_num_seqs = b
        t0 = time.monotonic()
        times = serve(llm, reqs)
        p = point(b, reqs, times, time.monotonic() - t0, args.ttft_slo, args.tpot_slo)
        points.append(p)
        print(f"{b:>12}{p['output_tok_s']:>11.1f}{p['goodput_req_s']:>9.2f}{p['ttft_s']['p50']:>9.2f}s"
              f"{p['ttft_s']['p99']:>7.1f}s{p['tpot_s']['p50'] * 1e3:>8.0f}ms{p['tpot_s']['p99'] * 1e3:>6.0f}ms")
    knee_b = knee(points)
    best_b = max(points, key=lambda p: (p["goodput_req_s"], -p["max_num_seqs"]))["max_num_seqs"]
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
               "args": {**vars(args), "request_rate": str(args.request_rate)},
               "workload": describe(reqs), "points": points, "knee_max_num_seqs": knee_b,
               "best_under_slo_max_num_seqs": best_b}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(points, knee_b, best_b, args, out.with_suffix(".png"))
    print(f"knee: max_num_seqs={knee_b}; best goodput under TTFT<={args.ttft_slo}s, TPOT<={args.tpot_slo}s: "
          f"max_num_seqs={best_b}\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
