"""Cascade routing, measured: how much of a large model's accuracy a small model keeps when a router sends it the
requests it can answer, and what that saves.

    python scripts/eval_cascade.py [--tiers SmolLM2-135M-Instruct,gemma3-270m] [--per-category 16] [--seed 0]
        [--out scripts/bench_results/cascade.json] [--router-out scripts/bench_results/cascade_router.json]
        [--plot docs/cascade_curve.png]
    python scripts/eval_cascade.py --records scripts/bench_results/cascade.json ...   # re-train / re-plot only
    python scripts/eval_cascade.py --tiers gemma3-270m:int4,gemma3-270m --reuse scripts/bench_results/cascade.json ...
        # tier 1's answers taken from an earlier run of the same questions; [--served-names small,large] names the
        # router file's tiers as the server serves them

A tier is a known model name, a GGUF or a model directory, with ":int4" / ":int8" / ":awq" for quantized weights
(e.g. `--tiers gemma3-270m:int4,gemma3-270m`: the same model quantized as the small tier). Tier 0 is the small one.

1. Questions with checkable answers, built by scripts/cascade_questions.py (no downloads): arithmetic of graded
   difficulty, facts and multiple choice, few-shot plain-text prompts, the same for every tier.
2. Each tier answers every question through the offline API (`jaxserve.LLM`, greedy, one batch per category):
   generation up to 12 tokens, stopped at a newline; multiple choice by loglikelihood (each option's summed
   prompt logprob given the question, `max_tokens=0, prompt_logprobs=0`). Cost is measured: a request's seconds are
   its category batch's wall time over the batch's requests (after a warm-up that compiles every step shape), and
   tokens in/out are counted.
3. Tier 0 also runs the router's scoring pass (`jaxserve.cascade.features.score_params`, timed the same way) for
   the prompt features, and its answers give the answer features (`answer_features`; a multiple-choice answer's
   tokens are the chosen option's, with their prompt logprobs).
4. A seeded split per category: the router is trained on one half (scripts/train_router.py: both policies, each
   threshold set on the train half to keep --target-retained of tier 1's accuracy) and written to --router-out;
   the other half gives the quality/cost curve as the threshold moves: share answered by tier 0, accuracy
   retained relative to tier 1 alone, cost saved relative to tier 1 alone ("before" pays tier 0's scoring pass for
   every request; "after" pays tier 0's whole answer for every request, tier 1's too for those it escalates).

Writes --out (every question's record, per-tier summary, the curves), --plot (needs matplotlib; skipped with a
note without it) and prints the table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import cascade_questions as cq
import numpy as np
import train_router as tr

QUANTIZATIONS = ("int4", "int8", "awq")
GENERATE_MAX_TOKENS = 12
ENGINE = dict(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512)


def tier_spec(spec: str) -> tuple[str, dict, str]:
    """'NAME[:QUANT[-gN]]' -> (model, engine quantization arguments, served name: NAME, or NAME-QUANT[-gN]).
    -gN: input rows per int4/awq group (quantization_group_size)."""
    model, _, quant = spec.partition(":")
    method, _, group = quant.partition("-g")
    if quant and (method not in QUANTIZATIONS or (group and not group.isdigit())):
        raise ValueError(f"tier {spec!r}: unknown quantization {quant!r} (one of {', '.join(QUANTIZATIONS)}, "
                         "int4 and awq with an optional -gN group size)")
    args = {"quantization": method or None}
    if group:
        args["quantization_group_size"] = int(group)
    name = Path(model).stem if model.endswith(".gguf") else Path(model).name
    return model, args, f"{name}-{quant}" if quant else name


# ---- running a tier ----

def _timed(llm, prompts: list, params) -> tuple[float, list]:
    llm.reset_prefix_cache()  # each batch pays for its own prompts (its few-shot header is shared within it)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _by_category(questions: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for q in questions:
        groups.setdefault(q["category"], []).append(q)
    return groups


def _choice_prompts(llm, q: dict) -> tuple[list[int], list[list[int]]]:
    """(context ids, [option ids]): the context as a prompt (BOS where the model adds one), each option's tokens
    encoded on their own after a space, so the context's tokens are the same in every option's prompt."""
    context = llm.tokenizer.encode(q["prompt"])
    return context, [llm.tokenizer.encode(" " + o, add_special_tokens=False) for o in q["options"]]


def answer(llm, questions: list[dict], keep_outputs: bool = False) -> tuple[dict[str, dict], dict[str, object]]:
    """Every question answered by `llm`: {id: {"answer", "correct", "seconds", "tokens_in", "tokens_out"}} and,
    with keep_outputs, {id: the CompletionOutput its answer features are computed from}."""
    from jaxserve import CompletionOutput, SamplingParams
    generate = SamplingParams(temperature=0, max_tokens=GENERATE_MAX_TOKENS, stop=["\n"], logprobs=0)
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    results, completions = {}, {}
    for category, qs in _by_category(questions).items():
        if qs[0]["kind"] == "generate":
            seconds, outs = _timed(llm, [q["prompt"] for q in qs], generate)
            for q, out in zip(qs, outs):
                c = out.outputs[0]
                results[q["id"]] = {"answer": c.text, "correct": cq.is_correct(q, c.text),
                                    "seconds": seconds / len(qs), "tokens_in": len(out.prompt_token_ids),
                                    "tokens_out": len(c.token_ids)}
                completions[q["id"]] = c
            continue
        encoded = [_choice_prompts(llm, q) for q in qs]
        prompts = [{"prompt_token_ids": ctx + opt} for ctx, opts in encoded for opt in opts]
        seconds, outs = _timed(llm, prompts, score)
        i = 0
        for q, (ctx, opts) in zip(qs, encoded):
            sums, chosen_logprobs = [], []
            for opt in opts:
                lp = outs[i].prompt_logprobs  # [len(ctx) + len(opt)]: None, then {token: Logprob}
                entries = [lp[len(ctx) + j] for j in range(len(opt))]
                sums.append(sum(e[t].logprob for e, t in zip(entries, opt)))
                chosen_logprobs.append(entries)
                i += 1
            best = int(np.argmax(sums))
            results[q["id"]] = {"answer": q["options"][best], "correct": best == q["label"],
                                "option_logprobs": [round(s, 4) for s in sums], "seconds": seconds / len(qs),
                                "tokens_in": sum(len(ctx) + len(o) for o in opts), "tokens_out": 0}
            # The chosen option as the answer a generation of those tokens would have given: its tokens with their
            # logprobs under this model.
            completions[q["id"]] = CompletionOutput(0, q["options"][best], list(opts[best]),
                                                    float(sums[best]), chosen_logprobs[best], "stop")
    return results, (completions if keep_outputs else {})


def score_features(llm, questions: list[dict]) -> tuple[dict[str, dict], dict[str, float]]:
    """Tier 0's scoring pass over every question's prompt (a multiple choice's context): {id: prompt features} and
    {id: seconds} (its category batch's wall time over its requests)."""
    from jaxserve.cascade.features import prompt_features, score_params
    features, seconds = {}, {}
    for category, qs in _by_category(questions).items():
        prompts = [q["prompt"] if q["kind"] == "generate" else {"prompt_token_ids": llm.tokenizer.encode(q["prompt"])}
                   for q in qs]
        wall, outs = _timed(llm, prompts, score_params())
        for q, out in zip(qs, outs):
            features[q["id"]] = prompt_features(out)
            seconds[q["id"]] = wall / len(qs)
    return features, seconds


def load_tier(spec: str):
    from jaxserve import LLM
    model, quant, _ = tier_spec(spec)
    start = time.perf_counter()
    llm = LLM(model, **quant, warmup=True, **ENGINE)  # warm-up: every step shape compiled before timing
    return llm, time.perf_counter() - start


def reusable(previous: dict | None, spec: str, questions: list[dict]) -> str | None:
    """The name under which `previous` (an earlier run's JSON) holds tier `spec`'s answers to these very questions
    (same ids, same prompts), or None."""
    if previous is None:
        return None
    name = next((n for n, e in previous.get("engines", {}).items() if e.get("spec") == spec), None)
    old = {r["id"]: r for r in previous.get("records", [])}
    if name is None or any(q["id"] not in old or old[q["id"]]["prompt"] != q["prompt"]
                           or name not in old[q["id"]]["tiers"] for q in questions):
        return None
    return name


def run_tiers(specs: list[str], questions: list[dict], log,
              previous: dict | None = None) -> tuple[list[str], list[dict], dict]:
    """Both tiers over every question; returns (served tier names, records, engine info). Tier 1's answers are
    taken from `previous` (an earlier run's JSON) when it ran that tier on the same questions."""
    from jaxserve.cascade.features import answer_features
    names = [tier_spec(s)[2] for s in specs]
    by_id = {q["id"]: dict(q, tiers={}) for q in questions}
    info = {}
    for t, spec in enumerate(specs):
        old_name = reusable(previous, spec, questions) if t > 0 else None
        if old_name is not None:
            old = {r["id"]: r for r in previous["records"]}
            for qid, rec in by_id.items():
                rec["tiers"][names[t]] = old[qid]["tiers"][old_name]
            info[names[t]] = dict(previous["engines"][old_name], reused_from=previous.get("date"))
            log(f"{names[t]}: answers reused from the earlier run")
            continue
        llm, load_s = load_tier(spec)
        log(f"{names[t]}: loaded and compiled in {load_s:.0f} s")
        llm.generate(questions[0]["prompt"], None, use_tqdm=False)  # one request through, untimed
        start = time.perf_counter()
        results, completions = answer(llm, questions, keep_outputs=t == 0)
        log(f"{names[t]}: answered {len(questions)} questions in {time.perf_counter() - start:.0f} s")
        for qid, r in results.items():
            by_id[qid]["tiers"][names[t]] = r
        if t == 0:
            start = time.perf_counter()
            features, seconds = score_features(llm, questions)
            log(f"{names[t]}: scoring pass in {time.perf_counter() - start:.0f} s")
            for qid, rec in by_id.items():
                rec["features"] = {**features[qid], **answer_features(completions[qid])}
                rec["score_seconds"] = seconds[qid]
        info[names[t]] = {"spec": spec, "model_path": str(llm.engine_config.model or "default"),
                          "quantization": llm.quantization, "load_and_compile_seconds": round(load_s, 1)}
        del llm, results, completions
        gc.collect()
    return names, list(by_id.values()), info


# ---- the analysis ----

def summarise(records: list[dict], tiers: list[str]) -> dict:
    """Per tier: accuracy (all, per group, test split), mean seconds and tokens per request."""
    out = {}
    for t in tiers:
        rs = [r["tiers"][t] for r in records]
        groups = sorted({r["group"] for r in records})
        out[t] = {"accuracy": float(np.mean([x["correct"] for x in rs])),
                  "accuracy_test": float(np.mean([r["tiers"][t]["correct"] for r in records if r["split"] == "test"])),
                  "accuracy_by_group": {g: float(np.mean([r["tiers"][t]["correct"] for r in records
                                                          if r["group"] == g])) for g in groups},
                  "seconds_per_request": float(np.mean([x["seconds"] for x in rs])),
                  "tokens_in_per_request": float(np.mean([x["tokens_in"] for x in rs])),
                  "tokens_out_per_request": float(np.mean([x["tokens_out"] for x in rs]))}
    small = np.array([r["tiers"][tiers[0]]["correct"] for r in records])
    large = np.array([r["tiers"][tiers[1]]["correct"] for r in records])
    out["agreement"] = {"both_right": float(np.mean(small & large)), "only_small_right": float(np.mean(small & ~large)),
                        "only_large_right": float(np.mean(~small & large)),
                        "both_wrong": float(np.mean(~small & ~large))}
    return out


def oracle(records: list[dict], tiers: list[str]) -> dict:
    """The best any router could do on these records: tier 0 keeps what it gets right (or what tier 1 gets wrong
    too), at no routing cost. A ceiling for the curves."""
    small, large = tr.correctness(records, tiers)
    keep = small | ~large
    cost_small = np.array([r["tiers"][tiers[0]]["seconds"] for r in records])
    cost_large = np.array([r["tiers"][tiers[1]]["seconds"] for r in records])
    accuracy = float(np.where(keep, small, large).mean())
    return {"share_small": float(keep.mean()), "accuracy": accuracy, "retained": accuracy / float(large.mean()),
            "cost_saved": 1 - float(np.where(keep, cost_small, cost_large).sum() / cost_large.sum())}


def analyse(records: list[dict], tiers: list[str], l2: float, target: float, provenance: dict):
    """Trains on the train split, sweeps on the test split. Returns (router, per-policy results)."""
    train = [r for r in records if r["split"] == "train"]
    test = [r for r in records if r["split"] == "test"]
    router, report = tr.train(train, tiers, l2, target, provenance)
    y_small, y_large = tr.correctness(test, tiers)
    results = {}
    for policy, clfs in (("before", router.before), ("after", router.after)):
        clf = clfs[0]
        p = tr.probabilities(clf, test)
        cost = tr.costs(test, tiers, policy)
        curve = tr.sweep(p, y_small, y_large, *cost)
        at_chosen = tr.sweep(p, y_small, y_large, *cost, thresholds=np.array([clf.threshold]))[0]
        results[policy] = {"features": list(clf.features), "weights": list(clf.weights), "bias": clf.bias,
                           "threshold": clf.threshold, "train_at_threshold": report[policy]["chosen"],
                           "test_at_threshold": at_chosen, "test_best_at_target": tr.choose(curve, target),
                           "test_auc": auc(p, y_small), "test_curve": curve}
    return router, results


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve of p as a predictor of y (ties count half): how well the classifier ranks right
    answers above wrong ones, whatever the threshold. 0.5 is chance."""
    pos, neg = p[y], p[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def plot(results: dict, orc: dict, tiers: list[str], target: float, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, x, label in ((axes[0], "share_small", f"share answered by {tiers[0]}"),
                         (axes[1], "cost_saved", f"cost saved vs {tiers[1]} alone (measured seconds)")):
        for policy, style in (("before", "-"), ("after", "--")):
            curve = results[policy]["test_curve"]
            # In threshold order: measured costs differ by category, so the cost panel's path need not be monotone.
            ax.plot([100 * c[x] for c in curve], [100 * c["retained"] for c in curve], style, marker=".",
                    markersize=3, lw=1, label=f"route {policy} generating")
            at = results[policy]["test_at_threshold"]
            ax.plot(100 * at[x], 100 * at["retained"], "o", color=ax.lines[-1].get_color())
        ax.plot(100 * orc[x], 100 * orc["retained"], "k*", markersize=10, label="oracle router (ceiling)")
        ax.axhline(100 * target, color="gray", lw=0.8, ls=":")
        ax.set_xlabel(label + " (%)")
        ax.set_ylabel(f"accuracy retained vs {tiers[1]} alone (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Cascade {tiers[0]} -> {tiers[1]}: test split; dots = thresholds set on the train split")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def print_table(summary: dict, results: dict, orc: dict, tiers: list[str], n_test: int, target: float) -> None:
    print(f"{'tier':<28}{'accuracy':>9}{'arith':>7}{'facts':>7}{'choice':>7}{'s/req':>8}{'tok in':>8}{'tok out':>8}")
    for t in tiers:
        s = summary[t]
        g = s["accuracy_by_group"]
        print(f"{t:<28}{100 * s['accuracy']:>8.1f}%{100 * g.get('arithmetic', 0):>6.0f}%"
              f"{100 * g.get('facts', 0):>6.0f}%{100 * g.get('choice', 0):>6.0f}%{s['seconds_per_request']:>8.3f}"
              f"{s['tokens_in_per_request']:>8.1f}{s['tokens_out_per_request']:>8.1f}")
    a = summary["agreement"]
    print(f"both right {100 * a['both_right']:.1f}%, only {tiers[0]} {100 * a['only_small_right']:.1f}%, "
          f"only {tiers[1]} {100 * a['only_large_right']:.1f}%, both wrong {100 * a['both_wrong']:.1f}%")
    print(f"\ntest split ({n_test} questions), thresholds set on the train split to keep {100 * target:.0f}%:")
    print(f"{'policy':<10}{'AUC':>6}{'threshold':>11}{'share small':>13}{'retained':>10}{'cost saved':>12}"
          f"   best on test at {100 * target:.0f}%: share / saved")
    for policy, r in results.items():
        at, best = r["test_at_threshold"], r["test_best_at_target"]
        print(f"{policy:<10}{r['test_auc']:>6.3f}{r['threshold']:>11.4f}{100 * at['share_small']:>12.1f}%"
              f"{100 * at['retained']:>9.1f}%{100 * at['cost_saved']:>11.1f}%   "
              f"{100 * best['share_small']:.1f}% / {100 * best['cost_saved']:.1f}%")
    print(f"{'oracle':<10}{'':>6}{'':>11}{100 * orc['share_small']:>12.1f}%{100 * orc['retained']:>9.1f}%"
          f"{100 * orc['cost_saved']:>11.1f}%")
    print("\ncurve (test split, 'before'): share small -> retained, cost saved")
    curve = results["before"]["test_curve"]
    for share in (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 1.0):
        c = min(curve, key=lambda c: abs(c["share_small"] - share))
        print(f"  {100 * c['share_small']:5.1f}% -> {100 * c['retained']:5.1f}%, {100 * c['cost_saved']:+6.1f}%")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} vCPU {cpu}, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="SmolLM2-135M-Instruct,gemma3-270m",
                    help="small,large: model names, GGUFs or directories, each with an optional :int4/:int8/:awq")
    ap.add_argument("--per-category", type=int, default=16,
                    help="questions per category (15 categories; 16: about 11 minutes on 2 CPU cores)")
    ap.add_argument("--served-names", help="the tiers' names in the router file, as `jaxserve serve` serves them "
                    "(--served-model-name; default: each tier's model name, with -int4 etc. when quantized)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the questions and the train/test split")
    ap.add_argument("--l2", type=float, default=1.0)
    ap.add_argument("--target-retained", type=float, default=0.95)
    ap.add_argument("--records", help="reuse this JSON's records (no model runs): re-train, re-sweep, re-plot")
    ap.add_argument("--reuse", help="an earlier run's JSON: take tier 1's answers (and measured costs) from it when it "
                                    "ran the same tier on the same questions, rather than running it again")
    ap.add_argument("--out", default="scripts/bench_results/cascade.json")
    ap.add_argument("--router-out", default="scripts/bench_results/cascade_router.json")
    ap.add_argument("--plot", default="docs/cascade_curve.png")
    args = ap.parse_args(argv)
    if not 0 < args.target_retained <= 1:
        ap.error(f"--target-retained must be in (0, 1], got {args.target_retained}")
    served = args.served_names.split(",") if args.served_names else None
    if served is not None and (len(served) != 2 or len(set(served)) != 2 or not all(served)):
        ap.error(f"--served-names needs two distinct names, small,large; got {args.served_names!r}")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    command = "python scripts/eval_cascade.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.records:
        try:
            old = json.loads(Path(args.records).read_text())
            tiers, records, engines = old["tiers"], old["records"], old.get("engines", {})
            meta = {k: old.get(k) for k in ("date", "machine", "seed", "per_category", "run_seconds")}
            meta["run_command"] = old.get("run_command", old.get("command"))  # the run that recorded the answers
            for r in records:  # graded again: the grader may have changed since the answers were recorded
                if r["kind"] == "generate":
                    for v in r["tiers"].values():
                        v["correct"] = cq.is_correct(r, v["answer"])
        except (OSError, ValueError, KeyError) as e:
            print(f"eval_cascade: cannot read records from {args.records}: {e}", file=sys.stderr)
            return 2
    else:
        specs = args.tiers.split(",")
        try:
            if len(specs) != 2:
                raise ValueError(f"--tiers needs exactly two tiers, small,large; got {len(specs)}")
            for s in specs:
                tier_spec(s)
        except ValueError as e:
            print(f"eval_cascade: {e}", file=sys.stderr)
            return 2
        questions = cq.build(args.per_category, args.seed)
        cq.split(questions, args.seed)
        log(f"{len(questions)} questions, {sum(q['split'] == 'test' for q in questions)} in the test split")
        start = time.perf_counter()
        previous = None
        if args.reuse:
            try:
                previous = json.loads(Path(args.reuse).read_text())
            except (OSError, ValueError) as e:
                print(f"eval_cascade: cannot read --reuse {args.reuse}: {e}", file=sys.stderr)
                return 2
        tiers, records, engines = run_tiers(specs, questions, log, previous)
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "seed": args.seed,
                "per_category": args.per_category, "run_seconds": round(time.perf_counter() - start, 1)}
    if args.served_names:
        rename = dict(zip(tiers, served))
        for r in records:
            r["tiers"] = {rename[t]: v for t, v in r["tiers"].items()}
        engines = {rename.get(t, t): v for t, v in engines.items()}
        tiers = served
    provenance = {"command": command, "tiers_accuracy_on": "train split", **{k: meta[k] for k in ("date", "seed")}}
    router, results = analyse(records, tiers, args.l2, args.target_retained, provenance)
    router.save(args.router_out)
    summary = summarise(records, tiers)
    orc = oracle([r for r in records if r["split"] == "test"], tiers)
    n_test = sum(r["split"] == "test" for r in records)
    print_table(summary, results, orc, tiers, n_test, args.target_retained)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "command": command, "tiers": tiers, "engines": engines, "engine_args": ENGINE,
                               "target_retained": args.target_retained, "l2": args.l2, "router_file": args.router_out,
                               "summary": summary, "oracle_test": orc, "policies": results, "records": records},
                              indent=1))
    wrote = [str(out), args.router_out]
    if args.plot and plot(results, orc, tiers, args.target_retained, Path(args.plot)):
        wrote.append(args.plot)
    print("wrote " + ", ".join(wrote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
