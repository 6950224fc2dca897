"""Acceptance of speculative verification on the default model: the coupled rule jaxserve verifies with, beside
rejection sampling (the rule before it), on the same positions.

    python scripts/bench_spec_acceptance.py [--draft PATH] [--draft-layers 15,24] [--prompts 8]
                                            [--max-tokens 96] [--k 4] [--out bench_results/spec_acceptance.json]

For each workload (bench_spec's `copy` and `chat` prompts) and sampling setting, the target samples its answers
(one seed per request, plain decoding: with coupled verification a speculating engine writes the same text).
Then, teacher-forced on prompt + answer, at each answer position t: the target's p_t and the draft's q_t, through
the sampling parameters as sample() processes them, normalised. The chance a proposal at t is accepted:

  n-gram (x: the first token prompt lookup proposes from the text before t; positions where it proposes one):
      rejection min(1, p(x) / 1) = p(x); coupled P(draw = x) = p(x). Equal by construction: measured as a check.
  draft model:  rejection sum_v min(p(v), q(v)) (the maximal coupling);
      coupled: the chance one uniform picks the same token from both inverse CDFs (token-id order), the sum over v
      of the overlap of [P(< v), P(<= v)) and [Q(< v), Q(<= v)).

Also the realised coupled acceptance, where the answer's token (the target's own draw) equals the proposal drawn
with the same key, and, end to end, the engines' own acceptance (speculating every step, k proposals: later
proposals are conditioned on the earlier ones being kept, so it differs from the per-position figure) and whether
their text is plain decoding's. Drafts: --draft, or untrained layer subsets of the target (its evenly spaced
layers, first and last included, as scripts/train_draft.py starts from): a spread of draft qualities.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import chat_prompts, copy_prompts  # noqa: E402
from train_draft import init_draft, save_draft, sequence_logits  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.batch import SamplingInput  # noqa: E402
from jaxserve.batching.speculation.ngram import NgramIndex  # noqa: E402
from jaxserve.model.decoder import DecoderModel  # noqa: E402
from jaxserve.sample.sampling import draw, processed_probs, step_keys  # noqa: E402
from jaxserve.sampling_params import MAX_BANNED_TOKENS  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402

SETTINGS = {"T=1.0": dict(temperature=1.0), "T=0.7, top_p=0.9": dict(temperature=0.7, top_p=0.9)}
NGRAM = dict(prompt_lookup_max=4, prompt_lookup_min=2)  # bench_spec's


def sampling_input(n: int, seed: int, first_step: int, vocab_size: int, temperature=1.0, top_k=0, top_p=1.0,
                   min_p=0.0) -> SamplingInput:
    """n rows of one request's parameters, for its generated token numbers first_step .. first_step + n - 1."""
    return SamplingInput(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32), min_p=jnp.full(n, min_p, jnp.float32),
        seed=jnp.full(n, seed, jnp.uint32), step=first_step + jnp.arange(n, dtype=jnp.int32),
        banned=jnp.full((n, MAX_BANNED_TOKENS), vocab_size, jnp.int32), min_tokens=jnp.zeros(n, jnp.int32),
        want_top_logprobs=jnp.zeros(n, bool))


@jax.jit
def target_side(p_logits, p: SamplingInput, proposals):
    """p_logits [n, V]: the target's at n positions; proposals [n] (n-gram, -1: none). Returns the target's draw
    there (sample()'s, [n]) and p(proposal) [n] (0 where none)."""
    pu = processed_probs(p_logits, p)  # [n, V], unnormalised
    P = pu / pu.sum(-1, keepdims=True)
    p_x = jnp.take_along_axis(P, jnp.maximum(proposals, 0)[:, None], 1)[:, 0]
    return draw(pu, step_keys(p.seed, p.step)), jnp.where(proposals >= 0, p_x, 0.0)


@jax.jit
def draft_side(p_logits, q_logits, p: SamplingInput):
    """p_logits, q_logits [n, V]: the target's and the draft's at n positions. Returns the draft's coupled draw
    (sample()'s with the target's keys, [n]), and rejection sampling's and the coupled rule's chance of accepting
    a draft proposal [n]."""
    pu, qu = processed_probs(p_logits, p), processed_probs(q_logits, p)  # [n, V], unnormalised
    P, Q = pu / pu.sum(-1, keepdims=True), qu / qu.sum(-1, keepdims=True)
    rejection = jnp.minimum(P, Q).sum(-1)
    # Token v is drawn from P where the uniform falls in [cp - P, cp): the coupled draws agree on the overlaps.
    cp, cq = jnp.cumsum(P, -1), jnp.cumsum(Q, -1)
    coupled = jnp.maximum(0.0, jnp.minimum(cp, cq) - jnp.maximum(cp - P, cq - Q)).sum(-1)
    return draw(qu, step_keys(p.seed, p.step)), rejection, coupled


def teacher_forced_logits(model, params, tokens: list[int], bucket: int = 128):
    """Logits [len(tokens), V] of one sequence, padded to a multiple of `bucket` (few compiled shapes)."""
    n = len(tokens)
    padded = -(-n // bucket) * bucket
    ids = np.zeros(padded, np.int32)
    ids[:n] = tokens
    positions = np.where(np.arange(padded) < n, np.arange(padded), -1).astype(np.int32)
    return _logits(model, params, jnp.asarray(ids), jnp.asarray(positions))[:n]


_logits = jax.jit(sequence_logits, static_argnums=0)


def ngram_first_proposals(prompt: list[int], output: list[int]) -> np.ndarray:
    """At each answer position t, the first token prompt lookup proposes from prompt + output[:t] (-1: none)."""
    index = NgramIndex(NGRAM["prompt_lookup_max"], NGRAM["prompt_lookup_min"])
    out = []
    for t in range(len(output)):
        index.tokens = prompt + output[:t]
        got = index.lookup(1)
        out.append(got[0] if got else -1)
    return np.array(out, np.int32)


def measure(target_model, target_params, drafts: dict, sequences: list[dict], vocab_size: int, setting: dict) -> dict:
    """Per-position acceptance over every sequence: {draft name: {rejection, coupled, realised}, "ngram": ...}."""
    acc = {name: {"rejection": [], "coupled": [], "realised": []} for name in drafts}
    ngram = {"p_x": [], "realised": []}
    reproduced = []
    for s in sequences:
        prompt, output = s["prompt"], s["output"]
        n = len(output)
        if n == 0:
            continue
        # Position prompt_len - 1 + t predicts answer token t (generated token number t).
        p_logits = teacher_forced_logits(target_model, target_params, prompt + output)[len(prompt) - 1:-1]
        p_in = sampling_input(n, s["seed"], 0, vocab_size, **setting)
        proposals = ngram_first_proposals(prompt, output)
        y = np.array(output)
        target_draw, p_x = map(np.asarray, target_side(p_logits, p_in, jnp.asarray(proposals)))
        reproduced.append(target_draw == y)
        has = proposals >= 0
        ngram["p_x"].append(p_x[has])
        ngram["realised"].append(proposals[has] == y[has])
        for name, (model, params) in drafts.items():
            q_logits = teacher_forced_logits(model, params, prompt + output)[len(prompt) - 1:-1]
            draft_draw, rejection, coupled = map(np.asarray, draft_side(p_logits, q_logits, p_in))
            acc[name]["rejection"].append(rejection)
            acc[name]["coupled"].append(coupled)
            acc[name]["realised"].append(draft_draw == y)
    out = {name: {k: float(np.concatenate(v).mean()) for k, v in d.items()} |
           {"positions": int(sum(map(len, d["coupled"])))} for name, d in acc.items()}
    px = np.concatenate(ngram["p_x"])
    out["ngram"] = {"rejection": float(px.mean()), "coupled": float(px.mean()),
                    "realised": float(np.concatenate(ngram["realised"]).mean()), "positions": int(px.size)}
    # The teacher-forced (dense attention) target reproduces the engine's draws: the positions are the engine's.
    out["target_draw_reproduced"] = float(np.concatenate(reproduced).mean())
    return out


def generate(llm, conversations, setting: dict, max_tokens: int, seed0: int):
    """The target's answers [token ids], the prompts' token ids and the requests' SamplingParams."""
    sps = [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **setting) for i in range(len(conversations))]
    outs = llm.chat(conversations, sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.prompt_token_ids for o in outs], sps


def engine_acceptance(llm, conversations, sps, plain: list) -> dict:
    before = llm.stats()
    outs = llm.chat(conversations, sps, use_tqdm=False)
    after = llm.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    same = sum(list(o.outputs[0].token_ids) == list(t) for o, t in zip(outs, plain))
    return {"acceptance": accepted / drafted if drafted else None, "draft_tokens": drafted,
            "same_text": f"{same}/{len(outs)}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a draft model checkpoint (scripts/train_draft.py writes one)")
    ap.add_argument("--draft-layers", default="15,24",
                    help="untrained drafts of this many of the target's layers, comma-separated ('' for none)")
    ap.add_argument("--prompts", type=int, default=8, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="proposals per verification in the engine runs")
    ap.add_argument("--no-engines", action="store_true", help="skip the speculating engines' end-to-end runs")
    ap.add_argument("--out", default="bench_results/spec_acceptance.json")
    args = ap.parse_args()
    start = time.perf_counter()
    llm = LLM(max_model_len=1024, max_num_seqs=args.prompts, max_num_batched_tokens=256, warmup=False)
    # The loaded, unfused params: the runner's own may be fused for CPU serving (jaxserve.model.fused), and a
    # draft cut from them must keep the checkpoint's projection names.
    config, params = llm.config, load_model(None, jnp.float32).params
    target_model = DecoderModel(config, jnp.float32, "dense")
    drafts, paths, tmp = {}, {}, tempfile.TemporaryDirectory()
    if args.draft:
        d = load_model(args.draft, jnp.float32)
        drafts["draft"] = (DecoderModel(d.config, jnp.float32, "dense"), d.params)
        paths["draft"] = args.draft
    for layers in [int(x) for x in args.draft_layers.split(",") if x]:
        d_config, d_params, chosen = init_draft(config, params, layers)
        name = f"{layers} layers"
        drafts[name] = (DecoderModel(d_config, jnp.float32, "dense"), d_params)
        if not args.no_engines:
            paths[name] = str(Path(tmp.name) / f"draft-{layers}")
            save_draft(Path(paths[name]), d_config, d_params, llm.get_tokenizer())
    workloads = {"copy": copy_prompts(args.prompts), "chat": chat_prompts(args.prompts)}

    results = []
    samples = {}
    for setting_name, setting in SETTINGS.items():
        for workload, conversations in workloads.items():
            outputs, prompt_ids, sps = generate(llm, conversations, setting, args.max_tokens, seed0=1000)
            samples[setting_name, workload] = (conversations, sps, outputs)
            seqs = [{"prompt": list(p), "output": list(o), "seed": sp.seed}
                    for p, o, sp in zip(prompt_ids, outputs, sps)]
            m = measure(target_model, params, drafts, seqs, config.vocab_size, setting)
            for name in ["ngram", *drafts]:
                results.append({"setting": setting_name, "workload": workload, "proposer": name, **m[name],
                                "target_draw_reproduced": m["target_draw_reproduced"]})
            print(f"{setting_name:18s} {workload:5s} measured ({time.perf_counter() - start:.0f} s)", flush=True)
    del llm

    engines = {} if args.no_engines else {
        "ngram": dict(method="ngram", num_speculative_tokens=args.k, adaptive=False, **NGRAM),
        **{name: dict(method="draft_model", model=path, num_speculative_tokens=args.k, adaptive=False)
           for name, path in paths.items()}}
    for name, spec in engines.items():
        llm = LLM(max_model_len=1024, max_num_seqs=args.prompts, max_num_batched_tokens=256, warmup=False,
                  speculative_config=spec)
        for (setting_name, workload), (conversations, sps, outputs) in samples.items():
            r = engine_acceptance(llm, conversations, sps, outputs)
            row = next(x for x in results if (x["setting"], x["workload"], x["proposer"]) ==
                       (setting_name, workload, name))
            row["engine"] = r
            print(f"engine {name:10s} {setting_name:18s} {workload:5s} {r}", flush=True)
        del llm

    print(f"\n{'setting':18s} {'workload':8s} {'proposer':10s} {'positions':>9s} {'rejection':>9s} {'coupled':>8s} "
          f"{'realised':>8s} {'engine k=' + str(args.k):>10s} {'same text':>9s}")
    for r in results:
        e = r.get("engine", {})
        eng = "-" if e.get("acceptance") is None else f"{e['acceptance']:.3f}"
        print(f"{r['setting']:18s} {r['workload']:8s} {r['proposer']:10s} {r['positions']:9d} {r['rejection']:9.3f} "
              f"{r['coupled']:8.3f} {r['realised']:8.3f} {eng:>10s} {e.get('same_text', '-'):>9s}")
    reproduced = min(r["target_draw_reproduced"] for r in results)
    print(f"teacher-forced target draws equal to the engine's tokens: {reproduced:.4f} of positions at the least")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"results": results, "argv": sys.argv,
                                          "seconds": time.perf_counter() - start}, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
