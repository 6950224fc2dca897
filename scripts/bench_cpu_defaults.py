"""What the CPU defaults of issue 53 give a wave of prompts arriving together (as 64 closed-loop clients return at
once): the old defaults (float32, a fixed 512-token step budget) against the new ones (dtype auto, the budget by
queue depth), and each change alone, interleaved in one process.

    python scripts/bench_cpu_defaults.py [--prompts 64] [--prompt-tokens 45] [--max-tokens 16] [--repeats 3]

Per configuration (median over --repeats waves, configurations in turn): the time until every request of the wave
has its first token (the wave's TTFT, its P50 and max), the steps that took, and the wave's total time and output
tokens/s. Default model; each engine compiles its steps on an untimed first wave. On a shared machine compare only
ratios inside one run.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

CONFIGS = {  # name -> (dtype, max_num_batched_tokens)
    "old: float32 + 512 fixed": ("float32", 512),
    "float32 + by queue depth": ("float32", None),
    "auto dtype + 512 fixed": ("auto", 512),
    "new: auto dtype + by queue depth": ("auto", None),
}


def wave(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    start = time.perf_counter()
    ids = {llm.add_request({"prompt_token_ids": p}, params).request_id for p in prompts}
    first: dict[str, float] = {}
    steps = steps_to_first = 0
    tokens = 0
    while llm.has_unfinished_requests():
        deltas = llm.step()
        steps += 1
        now = time.perf_counter() - start
        for d in deltas:
            tokens += len(d.token_ids)
            if d.seq.request_id in ids and d.token_ids and d.seq.request_id not in first:
                first[d.seq.request_id] = now
                if len(first) == len(ids):
                    steps_to_first = steps
    total = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"ttft_p50": statistics.median(ttft), "ttft_max": ttft[-1], "steps_to_first": steps_to_first,
            "total_s": total, "tok_s": tokens / total}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=45)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--out", default="bench_results/cpu_defaults.json")
    args = ap.parse_args()
    names = args.configs.split(",")
    llms = {n: LLM(dtype=CONFIGS[n][0], max_num_batched_tokens=CONFIGS[n][1], max_num_seqs=args.prompts,
                   max_model_len=256, kv_cache_memory_bytes=256 << 20, warmup=False) for n in names}
    vocab = next(iter(llms.values())).config.vocab_size

    def fresh(seed: int) -> list:  # new prompts every wave (the same for every config): no prefix-cache hits
        rng = np.random.default_rng(seed)
        return [rng.integers(100, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():  # compiles every step size the wave takes
        wave(llm, fresh(0), params)
    runs: dict = {n: [] for n in names}
    for i in range(args.repeats):
        for n in names:
            runs[n].append(wave(llms[n], fresh(1 + i), params))
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]} for n in names}
    base = med[names[0]]
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens at once, {args.max_tokens} tokens each; "
          f"medians of {args.repeats}, interleaved")
    print(f"{'config':<34}{'TTFT p50 s':>11}{'TTFT max s':>11}{'steps':>7}{'total s':>9}{'tok/s':>8}"
          f"{'TTFT max x':>11}{'tok/s x':>9}")
    for n in names:
        m = med[n]
        print(f"{n:<34}{m['ttft_p50']:>11.3f}{m['ttft_max']:>11.3f}{m['steps_to_first']:>7.0f}{m['total_s']:>9.2f}"
              f"{m['tok_s']:>8.1f}{m['ttft_max'] / base['ttft_max']:>11.2f}{m['tok_s'] / base['tok_s']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "args": vars(args),
                               "median": med, "runs": runs}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
