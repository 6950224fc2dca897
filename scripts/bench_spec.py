"""Speculative decoding on the default model: plain vs n-gram vs a draft model vs an EAGLE-3 head, adaptive or not,
where the output copies the input and where it does not.

    python scripts/bench_spec.py [--draft /tmp/draft-smollm2-4l] [--eagle3 /work/heads/smollm2-eagle3
                                 [--train-eagle3-if-missing]] [--batch-sizes 1,8,32] [--max-tokens 64] [--k 4]
                                 [--workloads copy,chat,code] [--repeats 1] [--out bench_results/spec.json]

Workloads (greedy, chat template): `copy` asks for a passage of Python's own documentation back verbatim (the
output repeats the input, as in "rewrite this code" or "fix this paragraph"); `chat` asks open-ended questions;
`code` asks for short programs (tasks the draft's and the head's training prompts do not hold). Each (workload,
batch size) runs B distinct requests together through LLM.chat; tok/s = generated tokens / wall time. Engines:
  plain                      no speculation (steps pipelined: step N+1 dispatched before step N is read)
  sync                       n-gram that never matches: every step waits for the one before, no proposals, so
                             its gap to `plain` is what speculation's host round trip costs
  ngram, draft, eagle3       every decoding sequence proposes k tokens every step (vLLM's behaviour)
  ngram-adaptive, draft-adaptive, eagle3-adaptive   the controller decides per step and per sequence from
                             measured costs
Every engine is built (and warmed up) first; then each (workload, batch) runs every engine in turn, --repeats
times, and the median rate is reported: the engines share the machine's noise rather than each meeting its own.
Also printed: vLLM's acceptance per position and mean accepted length, whether each engine's text is plain
greedy's, the step costs measured at warm-up (a head's or draft's step against the target's), and from them the
acceptance at which k proposals break even at batch 1.
"""
import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import spec_figures as sf

from jaxserve import LLM, SamplingParams
from jaxserve.batching.speculation.controller import expected_tokens

QUESTIONS = ["What makes a good teacher?", "Describe a walk through a forest in autumn.",
             "Why do people enjoy music?", "Give advice to someone starting their first job.",
             "What would you do with a free day?", "Explain why the sky looks blue.",
             "Write a short poem about the sea.", "What are the pros and cons of living in a big city?",
             "How can someone learn to cook?", "Tell me a story about a lost dog.",
             "What is the best way to learn a language?", "Why is sleep important?",
             "Describe your ideal house.", "What do you think cities will look like in 100 years?",
             "How do plants grow?", "Write a letter to a friend you have not seen in years."]


def copy_prompts(n: int) -> list[list[dict]]:
    """Passages of Python's language reference (shipped with Python), to be given back verbatim."""
    from pydoc_data.topics import topics
    texts = [topics[k] for k in sorted(topics)]
    out = []
    for text in texts:
        passage = text.strip()[:500].rsplit("\n", 1)[0]
        if len(passage) > 200:
            out.append([{"role": "user", "content": f"Copy this text exactly, and nothing else:\n\n{passage}"}])
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} passages")


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else
                                                                            " Answer in a different way.")}]
            for i in range(n)]


def engines(draft: str | None, eagle3: str | None, k: int) -> dict:
    ngram = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)
    out = {"plain": None,
           "sync": dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=1000, prompt_lookup_min=1000,
                        adaptive=False),
           "ngram": {**ngram, "adaptive": False}, "ngram-adaptive": ngram}
    for name, method, model in (("draft", "draft_model", draft), ("eagle3", "eagle3", eagle3)):
        if model:
            out[name] = dict(method=method, model=model, num_speculative_tokens=k, adaptive=False)
            out[f"{name}-adaptive"] = dict(method=method, model=model, num_speculative_tokens=k)
    return out


def ensure_head(head_dir: str, train: bool, train_args: str) -> None:
    """A missing head is trained (scripts/train_eagle3.py) when asked; otherwise a one-line exit."""
    if (Path(head_dir) / "config.json").exists():
        return
    if not train:
        sys.exit(f"no EAGLE-3 head at {head_dir}: train one with scripts/train_eagle3.py --out {head_dir}, or pass "
                 "--train-eagle3-if-missing")
    cmd = sf.train_command(sys.executable, Path(__file__).parent, head_dir, shlex.split(train_args))
    if not Path(cmd[1]).exists():
        sys.exit(f"cannot train the missing head: {cmd[1]} does not exist")
    print("training the EAGLE-3 head:", shlex.join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"training the EAGLE-3 head into {head_dir} failed (see its output above)")


def run(llm, conversations, max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.chat(conversations, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    d = sf.spec_delta(before, after)
    figures = sf.spec_figures(d)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steps": after.steps - before.steps,
            **figures, "tokens_per_verify": figures["mean_accepted_length"], **d,
            "texts": [o.outputs[0].text for o in outs]}


def hf_peers(workloads, tok, batch: int, max_tokens: int, k: int) -> list[dict]:
    """HF transformers on the same chat prompts, one at a time, greedy: plain and with prompt lookup (k tokens)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import peers

    from jaxserve.weights.default_model import default_model_path
    gguf = default_model_path()
    rows = []
    for workload, conversations in workloads.items():
        ids = [tok.encode(tok.apply_chat_template(c, True), add_special_tokens=False) for c in conversations[:batch]]
        for name, lookup in (("hf", None), ("hf-prompt-lookup", k)):
            r = peers.hf_generate(gguf.parent, gguf.name, ids, max_tokens, lookup)
            r["texts"] = [tok.decode(t) for t in r.pop("token_ids")]
            rows.append({"engine": name, "workload": workload, "batch": batch, "acceptance": None,
                         "mean_accepted_length": None, "acceptance_per_pos": None, "num_drafts": 0, "steps": 0, **r})
            print(f"{name:15s} {workload:5s} b{batch:<3d} {r['tok_s']:7.1f} tok/s", flush=True)
    return rows


def break_even(llm, k: int) -> list[dict]:
    """From the warm-up step costs at batch 1: the acceptance where k proposals' expected tokens pay the verify
    step (and the draft's k steps, when there is one) against a plain one-token step."""
    times = llm.runner.step_times
    proposer = llm.core.proposer
    draft_times = proposer.runner.step_times if hasattr(proposer, "runner") else None
    rows = []
    for j in range(1, k + 1):
        bucket = min(b for b in llm.runner.buckets.num_tokens if b >= j + 1)
        cost = times[bucket, k + 1]
        if draft_times:
            cost += draft_times[min(b for b in llm.runner.buckets.num_tokens if b >= 2), 1] + \
                (j - 1) * draft_times[1, 1]
        ratio = cost / times[1, 1]
        lo, hi = 0.0, 1.0
        for _ in range(40):  # expected_tokens grows with alpha: bisect for expected_tokens = ratio
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_tokens(mid, j) < ratio else (lo, mid)
        rows.append({"k": j, "cost_ratio": ratio, "break_even_acceptance": hi if ratio <= j + 1 else None})
    return rows


def step_costs(llm, k: int) -> dict:
    """The warm-up step costs the adaptive controller decides from: per token bucket, the proposer's step (draft
    or head) against the target's plain step, and a verification against a plain step; with break_even's rows."""
    controller = llm.core.controller
    buckets = llm.runner.buckets.num_tokens
    return {"per_bucket": sf.step_cost_ratios(controller.target_times, controller.draft_times or {}, buckets, k),
            "break_even": break_even(llm, k),
            "target_step_times": {f"{t},{r}": v for (t, r), v in controller.target_times.items()},
            "proposer_step_times": {f"{t},{r}": v for (t, r), v in (controller.draft_times or {}).items()}}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a draft model (scripts/train_draft.py writes one)")
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 head's directory (scripts/train_eagle3.py writes one)")
    ap.add_argument("--train-eagle3-if-missing", action="store_true",
                    help="train the --eagle3 head with scripts/train_eagle3.py when the directory has none")
    ap.add_argument("--train-eagle3-args", default="", help="further arguments for train_eagle3.py (quoted)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--engines", default=None, help="comma-separated subset of the engines above")
    ap.add_argument("--workloads", default="copy,chat,code")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (engine, workload, batch); median reported")
    ap.add_argument("--peers", default="hf", help="'hf': HF transformers generate() with and without prompt lookup "
                                                  "at batch 1 on the same prompts ('' for none)")
    ap.add_argument("--out", default="bench_results/spec.json")
    return ap.parse_args()


def main():
    args = parse_args()
    if args.eagle3:
        ensure_head(args.eagle3, args.train_eagle3_if_missing, args.train_eagle3_args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    makers = {"copy": copy_prompts, "chat": chat_prompts, "code": sf.code_prompts}
    workloads = {w: makers[w](max(batch_sizes)) for w in args.workloads.split(",")}
    chosen = engines(args.draft, args.eagle3, args.k)
    if args.engines:
        unknown = set(args.engines.split(",")) - set(chosen)
        if unknown:
            sys.exit(f"unknown or unavailable engines {sorted(unknown)} (have {sorted(chosen)})")
        chosen = {name: chosen[name] for name in args.engines.split(",")}
    llms, costs = {}, {}
    for name, spec in chosen.items():
        start = time.perf_counter()
        # KV for every sequence's 1024 tokens (~46 KiB a token, the draft's or head's share on top), not the 2 GiB
        # default: all the engines are alive at once.
        llms[name] = llm = LLM(max_model_len=1024, max_num_seqs=max(batch_sizes), max_num_batched_tokens=256,
                               kv_cache_memory_bytes=max(batch_sizes) * 1024 * 96 * 1024, speculative_config=spec)
        if spec is not None and spec.get("adaptive", True) is True and name.endswith("adaptive"):
            costs[name] = step_costs(llm, args.k)
        llm.chat(workloads[next(iter(workloads))][:1], SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)  # settle
        print(f"{name}: built and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for workload, conversations in workloads.items():
        for b in batch_sizes:
            runs: dict[str, list] = {name: [] for name in llms}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    llm.reset_prefix_cache()
                    runs[name].append(r := run(llm, conversations[:b], args.max_tokens))
                    print(f"{name:15s} {workload:5s} b{b:<3d} {r['tok_s']:7.1f} tok/s  acceptance "
                          f"{r['acceptance'] and round(r['acceptance'], 2)}  mean accepted length "
                          f"{r['mean_accepted_length'] and round(r['mean_accepted_length'], 2)}  "
                          f"drafts {r['num_drafts']}  steps {r['steps']}", flush=True)
            results += [{"engine": name, "workload": workload, "batch": b, **sf.median_run(rs)}
                        for name, rs in runs.items()]
    tokenizer = next(iter(llms.values())).tokenizer
    del llms
    if "hf" in args.peers.split(","):
        results += hf_peers(workloads, tokenizer, min(batch_sizes), args.max_tokens, args.k)
    sf.compare_to_plain(results)
    print("\n" + sf.markdown_table(results))
    for name, c in costs.items():
        print(f"\n{name}: warm-up step costs (best of 3) per token bucket: proposer step / target step, "
              f"verification of the bucket's rows x {args.k + 1} tokens / plain step")
        for row in c["per_bucket"]:
            ms = row["target_s"] and row["target_s"] * 1e3
            print(f"  T={row['tokens']:<4d} target {sf.num(ms)} ms  proposer {sf.num(row['head_over_target'])}x  "
                  f"verify {sf.num(row['verify_over_plain'])}x")
        print("  at batch 1, a round of k proposals costs (x a plain step = the mean accepted length it must beat); "
              "break-even acceptance")
        for row in c["break_even"]:
            be = row["break_even_acceptance"]
            print(f"  k={row['k']}: {row['cost_ratio']:.2f}x  break-even {'never' if be is None else f'{be:.2f}'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("texts")
    Path(args.out).write_text(json.dumps({"results": results, "step_costs": costs, "argv": sys.argv}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
