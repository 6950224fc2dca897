"""Offline throughput: the same seeded requests served by continuous batching, by static batching, and by llama.cpp.

    python scripts/bench_throughput.py [--num-requests 64] [--max-num-seqs 32] [--peers llamacpp]
                                       [--out bench_results/throughput.json]

Requests: log-normal prompt (median 128, 16..512) and output (median 64, 8..256) lengths, random token ids, greedy,
each generating exactly its max_tokens (ignore_eos), so every engine does the same work.
- continuous: all requests submitted at once to LLM.generate; a finished sequence's slot is refilled at once.
- static: the requests in consecutive batches of max_num_seqs; a batch runs until its longest member ends
  before the next batch starts (what an engine without iteration-level scheduling does).
- llama.cpp: scripts/peers.py llamacpp_serve, continuous batching with max_num_seqs slots, same GGUF.
Requests/s and output tokens/s are over the whole run's wall time; TTFT counts from submission (all at t=0, so
it includes queueing), TPOT = (finish - first token) / (output tokens - 1).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from bench_decode import machine  # noqa: E402
from workload import describe, percentiles, synth_requests  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.weights.default_model import default_model_path  # noqa: E402


def summarize(engine, mode, seconds, reqs, first_token_s, finish_s) -> dict:
    """Run-level figures from per-request times (seconds after the run's start)."""
    out_tokens = sum(r.max_tokens for r in reqs)
    ttft = [f - r.arrival for f, r in zip(first_token_s, reqs)]
    tpot = [(d - f) / (r.max_tokens - 1) for f, d, r in zip(first_token_s, finish_s, reqs) if r.max_tokens > 1]
    return {"engine": engine, "mode": mode, "seconds": round(seconds, 2),
            "requests_per_s": round(len(reqs) / seconds, 3), "output_tok_s": round(out_tokens / seconds, 1),
            "total_tok_s": round((out_tokens + sum(len(r.prompt_token_ids) for r in reqs)) / seconds, 1),
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot)}


def run_jaxserve(llm: LLM, reqs, batch: int | None = None) -> tuple[float, list, list]:
    """Serves reqs in one generate() call (batch None) or in consecutive generate() calls of `batch` requests.

    Returns (wall seconds, first-token times, finish times), both seconds after the start.
    """
    llm.reset_prefix_cache()  # no run may reuse an earlier run's prompts
    groups = [reqs] if batch is None else [reqs[i:i + batch] for i in range(0, len(reqs), batch)]
    outs = []
    t0 = time.monotonic()
    for group in groups:
        outs += llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in group],
                             [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in group],
                             use_tqdm=False)
    seconds = time.monotonic() - t0
    assert all(len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, reqs))
    return (seconds, [o.metrics.first_token_time - t0 for o in outs], [o.metrics.finished_time - t0 for o in outs])


def table(rows) -> None:
    print(f"{'engine':<46}{'mode':<12}{'s':>8}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}")
    for r in rows:
        print(f"{r['engine'][:45]:<46}{r['mode']:<12}{r['seconds']:>8.1f}{r['requests_per_s']:>8.2f}"
              f"{r['output_tok_s']:>11.1f}{r['ttft_s']['p50']:>10.2f}{r['tpot_s']['p50'] * 1e3:>8.0f}ms")


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['engine'].split(' (')[0].split(',')[0]}\n{r['mode']}" for r in rows]
    ax.barh(labels, [r["output_tok_s"] for r in rows], color=["C0", "C1", "C2", "C3"][:len(rows)])
    ax.set_xlabel("output tokens / s")
    ax.set_title("Same requests, same machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", default="llamacpp", help="llamacpp or empty")
    ap.add_argument("--out", default="bench_results/throughput.json")
    args = ap.parse_args()
    llm = LLM(max_model_len=1024, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = synth_requests(args.num_requests, args.seed, vocab=llm.config.vocab_size)
    engine = "jaxserve (float32, XLA:CPU)"
    seconds, first, finish = run_jaxserve(llm, reqs)
    rows = [summarize(engine, "continuous", seconds, reqs, first, finish)]
    stats = llm.stats()
    seconds, first, finish = run_jaxserve(llm, reqs, batch=args.max_num_seqs)
    rows.append(summarize(engine, "static", seconds, reqs, first, finish))
    if "llamacpp" in args.peers.split(","):
        r = peers.llamacpp_serve(str(default_model_path()), [(q.prompt_token_ids, q.max_tokens) for q in reqs],
                                 slots=args.max_num_seqs, n_batch=args.max_num_batched_tokens)
        rows.append(summarize(r["engine"], "continuous", r["seconds"], reqs, r["first_token_s"], r["finish_s"]))
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "args": vars(args),
               "workload": describe(reqs), "runs": rows,
               "continuous_over_static": round(rows[0]["output_tok_s"] / rows[1]["output_tok_s"], 2),
               "jaxserve_engine_stats": vars(stats)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["workload"]))
    table(rows)
    print(f"continuous / static (output tok/s): {results['continuous_over_static']:.2f}x")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
