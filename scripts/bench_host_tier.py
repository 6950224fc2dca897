"""TTFT of a shared-prefix workload when device KV pages are scarce, without and with the host KV tier (issue 49).

    python scripts/bench_host_tier.py [--model PATH] [--docs 4] [--doc-len 1024] [--question-len 16] [--rounds 3]
        [--device-docs 1.5] [--kv-offloading-size 1] [--out scripts/bench_results/host_tier.json]

Each request is one of --docs long documents (random token ids, --doc-len each) followed by a fresh question
(--question-len tokens), asking for 4 tokens; requests run one at a time, cycling through the documents --rounds
times. The device's KV cache holds about --device-docs documents beside the running request's pages (--page-bytes:
one page's bytes, by default the default model's float32 page: 2 x 30 layers x 16 tokens x 3 KV heads x 64 x 4
bytes), so without the tier each document has been evicted by the time it comes back and is prefilled again; with
it, its pages come back from host memory. Both engines warm up first (nothing compiles while timed). TTFT: a
request's first token time less its arrival; the first round (every document new) apart from the later ones. Token
ids are drawn from [100, 40000): a model with a smaller vocabulary needs another range. Prints a table; writes JSON.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from jaxserve import LLM, SamplingParams

DEFAULT_PAGE_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M, float32 pages of 16 tokens


def run(args, size: float | None) -> dict:
    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(100, 40000, args.doc_len).tolist() for _ in range(args.docs)]
    pages = int(args.device_docs * args.doc_len / 16) + -(-(args.doc_len + args.question_len + 4) // 16) + 1
    llm = LLM(args.model, max_model_len=args.doc_len + args.question_len + 8, kv_cache_memory_bytes=pages *
              args.page_bytes, max_num_batched_tokens=512, warmup=True, kv_offloading_size=size)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ttft: list[list[float]] = []
    start = time.perf_counter()
    for _ in range(args.rounds):
        ttft.append([])
        for doc in docs:
            prompt = doc + rng.integers(100, 40000, args.question_len).tolist()
            m = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].metrics
            ttft[-1].append(m.first_token_time - m.arrival_time)
    s = llm.stats()
    return dict(kv_offloading_size=size, seconds=time.perf_counter() - start, device_pages=pages,
                ttft_first_round_s=statistics.mean(ttft[0]),
                ttft_later_rounds_s=statistics.mean(t for r in ttft[1:] for t in r) if args.rounds > 1 else None,
                prompt_tokens=s.prompt_tokens, prefix_cache_hits=s.prefix_cache_hits, kv_offload_hits=s.kv_offload_hits,
                loaded_bytes=s.kv_offload_loaded_bytes, load_seconds=s.kv_offload_load_seconds,
                stored_bytes=s.kv_offload_stored_bytes, store_seconds=s.kv_offload_store_seconds,
                num_preemptions=s.num_preemptions)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device-docs", type=float, default=1.5)
    p.add_argument("--page-bytes", type=int, default=DEFAULT_PAGE_BYTES)
    p.add_argument("--kv-offloading-size", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="scripts/bench_results/host_tier.json")
    args = p.parse_args()
    results = [run(args, None), run(args, args.kv_offloading_size)]
    print(f"{'tier':>8} {'TTFT r1 s':>10} {'TTFT r2+ s':>11} {'prefilled':>10} {'host hits':>10} {'loaded MB':>10} "
          f"{'load s':>8} {'stored MB':>10} {'store s':>8}")
    for r in results:
        later = r["ttft_later_rounds_s"]
        print(f"{'off' if r['kv_offloading_size'] is None else 'on':>8} {r['ttft_first_round_s']:>10.3f} "
              f"{later if later is not None else float('nan'):>11.3f} {r['prompt_tokens']:>10} "
              f"{r['kv_offload_hits']:>10} {r['loaded_bytes'] / 1e6:>10.1f} {r['load_seconds']:>8.3f} "
              f"{r['stored_bytes'] / 1e6:>10.1f} {r['store_seconds']:>8.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
