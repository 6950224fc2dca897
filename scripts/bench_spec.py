"""Speculative decoding on the default model: plain vs n-gram vs a draft model vs adaptive, where the output copies
the input and where it does not.

    python scripts/bench_spec.py [--draft /tmp/draft-smollm2-4l] [--batch-sizes 1,8,32] [--max-tokens 64]
                                 [--k 4] [--out bench_results/spec.json]

Workloads (greedy, chat template): `copy` asks for a passage of Python's own documentation back verbatim (the
output repeats the input, as in "rewrite this code" or "fix this paragraph"); `chat` asks open-ended questions.
Each (workload, batch size) runs B distinct requests together through LLM.generate; tok/s = generated tokens /
wall time. Engines:
  plain                      no speculation (steps pipelined: step N+1 dispatched before step N is read)
  sync                       n-gram that never matches: every step waits for the one before, no proposals, so
                             its gap to `plain` is what speculation's host round trip costs
  ngram, draft               every decoding sequence proposes k tokens every step (vLLM's behaviour)
  ngram-adaptive, draft-adaptive   the controller decides per step and per sequence from measured costs
Also printed: the step costs measured at warm-up, and from them the acceptance rate at which k proposals break
even at batch 1 (against the usual rule of thumb of ~75%).
"""
import argparse
import json
import sys
import time
from pathlib import Path

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


def engines(draft: str | None, k: int) -> dict:
    ngram = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)
    out = {"plain": None,
           "sync": dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=1000, prompt_lookup_min=1000,
                        adaptive=False),
           "ngram": {**ngram, "adaptive": False}, "ngram-adaptive": ngram}
    if draft:
        out["draft"] = dict(method="draft_model", model=draft, num_speculative_tokens=k, adaptive=False)
        out["draft-adaptive"] = dict(method="draft_model", model=draft, num_speculative_tokens=k)
    return out


def run(llm, conversations, max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.chat(conversations, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    d = {k: getattr(after, f"spec_decode_{k}") - getattr(before, f"spec_decode_{k}")
         for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steps": after.steps - before.steps,
            "acceptance": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
            # Tokens a verification emits: its accepted proposals and the target's own token.
            "tokens_per_verify": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None,
            **d, "texts": [o.outputs[0].text for o in outs]}


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
                         "tokens_per_verify": None, "num_drafts": 0, "steps": 0, **r})
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a draft model (scripts/train_draft.py writes one)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--engines", default=None, help="comma-separated subset of the engines above")
    ap.add_argument("--peers", default="hf", help="'hf': HF transformers generate() with and without prompt lookup "
                                                  "at batch 1 on the same prompts ('' for none)")
    ap.add_argument("--out", default="bench_results/spec.json")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = {"copy": copy_prompts(max(batch_sizes)), "chat": chat_prompts(max(batch_sizes))}
    chosen = engines(args.draft, args.k)
    if args.engines:
        chosen = {name: chosen[name] for name in args.engines.split(",")}
    results, costs = [], {}
    for name, spec in chosen.items():
        llm = LLM(max_model_len=1024, max_num_seqs=max(batch_sizes), max_num_batched_tokens=256,
                  speculative_config=spec)
        if spec is not None and spec.get("adaptive", True) is True and name.endswith("adaptive"):
            costs[name] = break_even(llm, args.k)
        tokenizer = llm.tokenizer
        llm.chat(workloads["chat"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # settle
        for workload, conversations in workloads.items():
            for b in batch_sizes:
                llm.reset_prefix_cache()
                r = run(llm, conversations[:b], args.max_tokens)
                results.append({"engine": name, "workload": workload, "batch": b, **r})
                print(f"{name:15s} {workload:5s} b{b:<3d} {r['tok_s']:7.1f} tok/s  acceptance "
                      f"{r['acceptance'] if r['acceptance'] is None else round(r['acceptance'], 2)}  "
                      f"tokens/verify {r['tokens_per_verify'] and round(r['tokens_per_verify'], 2)}  "
                      f"drafts {r['num_drafts']}  steps {r['steps']}", flush=True)
        del llm
    if "hf" in args.peers.split(","):
        results += hf_peers(workloads, tokenizer, min(batch_sizes), args.max_tokens, args.k)
    plain = {(r["workload"], r["batch"]): r for r in results if r["engine"] == "plain"}
    print(f"\n{'engine':15s} {'workload':8s} {'batch':>5s} {'tok/s':>7s} {'speedup':>7s} {'accept':>6s} "
          f"{'tok/verify':>10s} {'same text':>9s}")
    for r in results:
        base = plain.get((r["workload"], r["batch"]))
        r["speedup"] = r["tok_s"] / base["tok_s"] if base else None
        same = sum(a == b for a, b in zip(r["texts"], base["texts"])) if base else 0
        r["same_text"] = f"{same}/{len(r['texts'])}"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        print(f"{r['engine']:15s} {r['workload']:8s} {r['batch']:5d} {r['tok_s']:7.1f} "
              f"{r['speedup'] or 0:7.2f} {acc:>6s} {tpv:>10s} {r['same_text']:>9s}")
    for name, rows in costs.items():
        print(f"\n{name}: at batch 1, verifying k proposals costs (x a plain step); break-even acceptance")
        for row in rows:
            be = row["break_even_acceptance"]
            print(f"  k={row['k']}: {row['cost_ratio']:.2f}x  break-even {'never' if be is None else f'{be:.2f}'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("texts")
    Path(args.out).write_text(json.dumps({"results": results, "break_even": costs, "argv": sys.argv}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
