"""What the cascade's `before` scoring pass costs against a 1-token prefill of the same prompts, interleaved.

    python scripts/bench_cascade_scoring.py [--model PATH] [--prompts 24] [--repeats 4]
                                            [--out scripts/bench_results/cascade_scoring.json]

Each mode is one batch of the cascade benchmark's few-shot prompts (`scripts/cascade_questions.py`, ~60-80 tokens;
`LLM.generate`, the prefix cache reset before it, every step shape compiled before timing), its wall time:
- prefill: one greedy token (the LM head at each prompt's last token only);
- score: `jaxserve.cascade.features.score_params` (the prompt's own logprobs, prompt_logprobs 0: the head and a
  log-softmax at every prompt position, no top-k);
- score, old: the same pass with the step made to run the top-k at every prompt position anyway (each row's
  prompt_top forced on), as every scoring pass did before: the old cost, in the same process.
The modes alternate within each repeat; the table gives each one's median and its ratio to prefill's.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cascade_questions as cq  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.batching import step_rows  # noqa: E402
from jaxserve.cascade.features import score_params  # noqa: E402

ENGINE = dict(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512)  # eval_cascade.py's
_PROMPT_TARGETS = step_rows.prompt_targets


MODES = ("prefill", "score", "score, old")


def old_top_k(on: bool) -> None:
    """Makes every scored prompt position ask the step for its top-n (on), as before prompt_top, or not."""
    targets = _PROMPT_TARGETS
    step_rows.prompt_targets = (lambda chunk: {**targets(chunk), "prompt_top": True} if targets(chunk) else {}) \
        if on else targets


def params(mode: str) -> SamplingParams:
    old_top_k(mode == "score, old")
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True) if mode == "prefill" else score_params()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (the cascade's small tier)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="scripts/bench_results/cascade_scoring.json")
    args = ap.parse_args(argv)
    llm = LLM(args.model, warmup=True, **ENGINE) if args.model else LLM(warmup=True, **ENGINE)
    prompts = [q["prompt"] for q in cq.build(4) if q["kind"] == "generate"][:args.prompts]
    tokens = [len(llm.tokenizer.encode(p)) for p in prompts]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:  # compile whatever warm-up missed (the scorer's branches)
        llm.generate(prompts[:2], params(m), use_tqdm=False)
    for _ in range(args.repeats):
        for m in MODES:
            p = params(m)
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, p, use_tqdm=False)
            times[m].append(time.perf_counter() - start)
    base = statistics.median(times["prefill"])
    rows = {m: {"median_s": statistics.median(t), "ratio_to_prefill": statistics.median(t) / base, "runs_s": t}
            for m, t in times.items()}
    print(f"{len(prompts)} prompts, {statistics.mean(tokens):.1f} tokens each, {args.repeats} interleaved repeats")
    print(f"{'mode':<12} {'median s':>9} {'x prefill':>9}")
    for m, r in rows.items():
        print(f"{m:<12} {r['median_s']:>9.3f} {r['ratio_to_prefill']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": len(prompts), "mean_prompt_tokens": statistics.mean(tokens),
                               "engine": ENGINE, "model": args.model or "default", "modes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
