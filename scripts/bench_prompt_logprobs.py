"""Prompt-logprob scoring (what lm-evaluation-harness's loglikelihood requests cost): jaxserve against HF
transformers on the same weights (the default model's GGUF, float32, this machine's CPU), in one run.

    python scripts/bench_prompt_logprobs.py [--prompts 64] [--prompt-len 512] [--max-num-batched-tokens 2048]
                                            [--hf-batch 4] [--out bench_results/prompt_logprobs.json]

Rows: jaxserve scoring every prompt position (`SamplingParams(max_tokens=0, prompt_logprobs=1)`, the shape of an
lm-eval request), jaxserve's plain prefill of the same prompts (max_tokens=1, nothing scored: what scoring adds to
it), and HF's forward + log_softmax + gather (batches of --hf-batch prompts). The prompts are windows of real text
(tests/data), distinct, so the prefix cache has nothing to give (and is reset between runs). jaxserve runs the
workload once untimed first (compiling its step buckets), then timed. Also: the largest difference between the two
systems' logprobs over every position.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxserve import LLM, SamplingParams

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = " ".join((DATA / name).read_text() for name in ("alice_ch1.txt", "gettysburg.txt"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = (ids * (-(-(count + length) // len(ids)) + 1))  # long enough for every window
    stride = max(1, (len(ids) - length) // count)
    return [ids[i * stride:i * stride + length] for i in range(count)]


def run_jaxserve(llm: LLM, prompts, params) -> tuple[float, list]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def run_hf(model, prompts, batch: int) -> tuple[float, list[np.ndarray]]:
    import torch
    scores = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])
            logprobs = torch.log_softmax(model(ids).logits.float(), -1)  # [B, L, V]
            scores += list(torch.gather(logprobs[:, :-1], 2, ids[:, 1:, None])[..., 0].numpy())
    return time.perf_counter() - start, scores


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch", type=int, default=4)
    ap.add_argument("--out", default="bench_results/prompt_logprobs.json")
    args = ap.parse_args()

    import torch
    import transformers

    from jaxserve.weights.default_model import default_model_path
    llm = LLM(max_model_len=args.prompt_len + 16, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=64, warmup=False)
    prompts = make_prompts(llm.tokenizer, args.prompts, args.prompt_len)
    tokens = sum(len(p) for p in prompts)
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    prefill = SamplingParams(max_tokens=1, temperature=0)
    run_jaxserve(llm, prompts, score)  # compiles the buckets this workload steps through
    run_jaxserve(llm, prompts, prefill)
    t_score, outs = run_jaxserve(llm, prompts, score)
    t_prefill, _ = run_jaxserve(llm, prompts, prefill)

    path = default_model_path()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    run_hf(hf, prompts[:args.hf_batch], args.hf_batch)  # warm
    t_hf, hf_scores = run_hf(hf, prompts, args.hf_batch)

    ours = [np.array([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
            for out, p in zip(outs, prompts)]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, hf_scores))
    rows = [("jaxserve prompt_logprobs=1, max_tokens=0", t_score),
            ("jaxserve prefill only (max_tokens=1)", t_prefill),
            (f"HF transformers forward + log_softmax (batch {args.hf_batch})", t_hf)]
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, default model, float32, CPU "
          f"(max_num_batched_tokens {args.max_num_batched_tokens})")
    print(f"{'':<52} {'seconds':>9} {'tokens/s':>10}")
    for name, t in rows:
        print(f"{name:<52} {t:>9.2f} {tokens / t:>10.0f}")
    print(f"scoring over prefill: {t_score / t_prefill:.2f}x; jaxserve over HF: {t_hf / t_score:.2f}x faster")
    print(f"largest |logprob difference| against HF over {tokens - len(prompts)} positions: {diff:.2e}")
    result = {"prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": tokens,
              "max_num_batched_tokens": args.max_num_batched_tokens, "hf_batch": args.hf_batch,
              "seconds": {name: t for name, t in rows}, "tokens_per_s": {name: tokens / t for name, t in rows},
              "max_abs_logprob_diff": diff}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
