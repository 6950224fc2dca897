"""What logit controls (penalties, logit_bias, bad_words) cost: the default model's decode step with them against
plain rows, and the host's work to build a step's batch with them.

    python scripts/bench_logit_controls.py [--rows 64] [--context 512] [--steps 16] [--repeats 3]
                                           [--parts device,host,long] [--long-contexts 8192,32768,131072]
                                           [--out scripts/bench_results/logit_controls.json]

Decode: ms per engine step (host loop included: planning, the batch, the step, the one copy back) over `steps`
steps of `rows` greedy sequences after the same `context`-token prompt (prefix-cached), the median of `repeats`;
every row plain, every row controlled, or one row controlled among plain ones (a batch pays for a control once any
row uses it). Host: ms to lay out `rows` decode rows of `context` tokens (row_sampling for each, then build_batch),
and with the penalties' history copied from the token lists instead of each sequence's token array. Long (not run
by default): the penalties' work on a decode step at long contexts, their history sent each step (before) against
their counts kept on device per slot (after) and plain rows (`long_context_ms`).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.batching.sequence import Sequence  # noqa: E402
from jaxserve.batching.step_rows import row_sampling  # noqa: E402
from jaxserve.buckets import round_up  # noqa: E402
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch  # noqa: E402
from jaxserve.sample.logit_controls import resolve  # noqa: E402
from jaxserve.sampling_params import MAX_LOGIT_BIAS  # noqa: E402

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)


def controls(vocab_size: int) -> dict:
    rng = np.random.default_rng(0)
    bias = {int(t): float(b) for t, b in zip(rng.choice(vocab_size, MAX_LOGIT_BIAS, replace=False),
                                             rng.uniform(-5, 5, MAX_LOGIT_BIAS))}
    return {"penalties": PENALTIES, f"logit_bias ({MAX_LOGIT_BIAS} ids)": dict(logit_bias=bias),
            "bad_words (8)": dict(bad_words=["apple pie", "banana", "the end", "Paris", "however", "x y z", "no", "!"]),
            "all of them": dict(PENALTIES, logit_bias=bias)}


def sequences(llm, prompt, count, params, name):
    c = resolve(params, llm.config.vocab_size, llm.tokenizer)
    return [Sequence(f"{name}-{i}", 0, prompt, params, i, llm.max_model_len, [], controls=c) for i in range(count)]


def decode_rows(llm, prompt, rows, extra: dict | None, controlled_rows: int) -> list[Row]:
    """`rows` decode rows of len(prompt) + 8 tokens (8 generated), the first `controlled_rows` with the controls."""
    r = llm.runner
    base = dict(temperature=0, max_tokens=64, ignore_eos=True)
    seqs = sequences(llm, prompt, controlled_rows, SamplingParams(**base, **(extra or {})), "controlled") + \
        sequences(llm, prompt, rows - controlled_rows, SamplingParams(**base), "plain")
    generated = np.random.default_rng(1).integers(0, llm.config.vocab_size, 8).tolist()
    for s in seqs:  # as if 8 tokens had been generated
        s.output_token_ids += generated
        if s.token_ids_array is not None:
            s.token_ids_array[len(prompt):len(prompt) + 8] = generated
    pages = list(range(1, 1 + -(-(len(prompt) + 9) // r.page_size)))
    return seqs, [Row([s.last_token], s.num_tokens - 1, pages, row_sampling(s), i) for i, s in enumerate(seqs)]


def device_ms(llm, batches: dict, rounds: int) -> dict:
    """Median ms of each batch's step (its copy to the device, the forward and sampling, the cache write), the
    batches taken in turn so that the shared machine's drift falls on all of them alike."""
    import jax
    r = llm.runner
    times = {name: [] for name in batches}
    for _ in range(rounds + 1):
        for name, batch in batches.items():
            t = time.perf_counter()
            jax.block_until_ready(r.run(batch).tokens)
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t[1:]) for name, t in times.items()}  # the first round compiles


def sampler_ms(llm, batches: dict, rounds: int) -> dict:
    """Median ms of the sampler alone (the step's tokens into the controls, then sample()) on random [rows, V]
    logits, for each batch, in turn: the controls' own cost, measured where a shared machine's noise is small."""
    import jax

    from jaxserve.sample.sampling import sample, with_step_tokens

    @jax.jit
    def sampler(logits, batch):
        p = with_step_tokens(batch.sampling, batch.token_ids, batch.rows, batch.logits_index[:, 0])
        return sample(logits, p).tokens
    r = llm.runner
    on_device = {name: r.steps.put_batch(b) for name, b in batches.items()}
    S = next(iter(batches.values())).num_rows
    logits = jax.random.normal(jax.random.key(0), (S, llm.config.vocab_size)) * 3
    times = {name: [] for name in batches}
    for _ in range(rounds + 1):
        for name, b in on_device.items():
            t = time.perf_counter()
            jax.block_until_ready(sampler(logits, b))
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def long_context_ms(llm, rows: int, contexts: list[int], rounds: int) -> list[dict]:
    """A decode step's penalty work at long contexts, without the model (whose KV cache would not fit): the host's
    batch (build_batch), its copy to the device and the sampler (the step's tokens into the controls, then sample())
    on random logits, median ms of `rounds`, each case in turn: every row plain; every row with the penalties
    counted from its history (`past_tokens` [rows, context] sent each step: before); counted in its slot of the
    device's counts (`jaxserve.sample.penalty_counts`: after, no history sent)."""
    import dataclasses

    import jax

    from jaxserve.sample.penalty_counts import empty_counts
    from jaxserve.sample.sampling import sample, with_step_tokens

    def step(logits, batch, state):
        p = with_step_tokens(dataclasses.replace(batch.sampling, penalty_state=state), batch.token_ids, batch.rows,
                             batch.logits_index[:, 0])
        return sample(logits, p).tokens, p.penalty_state
    sampler = jax.jit(step, donate_argnums=2)
    r, V = llm.runner, llm.config.vocab_size
    rng = np.random.default_rng(0)
    logits = jax.random.normal(jax.random.key(0), (rows, V)) * 3
    tokens = round_up(rows, r.buckets.num_tokens)
    results = []
    for context in contexts:
        history = [rng.integers(0, V, context).astype(np.int32) for _ in range(rows)]
        width = -(-context // r.page_size)
        pages = list(range(1, width + 1))

        def sampling(case, i):
            if case == "plain":
                return RowSampling()
            return RowSampling(**PENALTIES, prompt_len=context - 8, past_tokens=history[i] if case == "before" else
                               None, penalty_slot=-1 if case == "before" else i)
        cases = ("plain", "before", "after")
        state = {"after": empty_counts(rows + 1, V)}
        times: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(rounds + 1):
            for case in cases:
                t = time.perf_counter()
                batch = build_batch([Row([int(history[i][-1])], context - 1, pages, sampling(case, i), i)
                                     for i in range(rows)], r.page_size, V, tokens, r.buckets.num_rows(tokens), width)
                out, state[case] = sampler(logits, r.steps.put_batch(batch), state.get(case))
                jax.block_until_ready(out)
                times[case].append((time.perf_counter() - t) * 1e3)
        ms = {c: statistics.median(t[1:]) for c, t in times.items()}  # the first round compiles
        results += [dict(context=context, case=c, ms=round(ms[c], 3), vs_plain=round(ms[c] / ms["plain"], 3))
                    for c in cases]
    return results


def host_ms(llm, prompt, rows, extra: dict | None, from_lists=False, repeats=200) -> dict:
    """row_sampling + build_batch for `rows` decode rows of len(prompt) + 8 tokens: the median and the fastest (the
    least disturbed by other work on a shared machine) of `repeats`."""
    r = llm.runner
    seqs, batch_rows = decode_rows(llm, prompt, rows, extra, rows)
    tokens = round_up(rows, r.buckets.num_tokens)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        laid_out = []
        for row, s in zip(batch_rows, seqs):
            sampling = row_sampling(s)
            if from_lists and sampling.past_tokens is not None:
                sampling.past_tokens = np.asarray(s.token_ids[:s.num_tokens], np.int32)
            laid_out.append(Row(row.token_ids, row.start_pos, row.pages, sampling, row.slot, chained=True))
        build_batch(laid_out, r.page_size, r.config.vocab_size, tokens, r.buckets.num_rows(tokens),
                    r.buckets.pages_per_row)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median": round(statistics.median(times), 3), "min": round(min(times), 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20, help="steps of each batch, taken in turn")
    ap.add_argument("--max-model-len", type=int, default=8192, help="the default model's own: the past tokens' width")
    ap.add_argument("--parts", default="device,host", help="comma list of device, host, long")
    ap.add_argument("--long-contexts", default="8192,32768,131072",
                    help="the contexts of the long part (the penalties' counts against their history)")
    ap.add_argument("--out", default="scripts/bench_results/logit_controls.json")
    args = ap.parse_args()
    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=args.rows, max_num_batched_tokens=512, warmup=False)
    prompt = peers._prompt_ids(args.context, llm.config.vocab_size)
    cases = controls(llm.config.vocab_size)
    r = llm.runner
    tokens = round_up(args.rows, r.buckets.num_tokens)

    def batch(extra, controlled):
        return build_batch(decode_rows(llm, prompt, args.rows, extra, controlled)[1], r.page_size,
                           llm.config.vocab_size, tokens, r.buckets.num_rows(tokens), r.buckets.pages_per_row)
    parts = set(args.parts.split(","))
    decode, host, long = [], [], []
    if "long" in parts:
        long = long_context_ms(llm, args.rows, [int(c) for c in args.long_contexts.split(",")], args.rounds)
    if "device" in parts:
        batches = {("plain", 0): batch(None, 0)}
        for name, extra in cases.items():
            for controlled in (args.rows, 1):
                batches[name, controlled] = batch(extra, controlled)
        ms = device_ms(llm, batches, args.rounds)
        alone = sampler_ms(llm, batches, 5 * args.rounds)
        plain, plain_sampler = ms["plain", 0], alone["plain", 0]
        # The controls' cost on the step: what they add to the sampler, over the plain step's time.
        decode = [dict(case=name, rows_controlled=controlled, step_ms=round(t, 2), vs_plain=round(t / plain, 3),
                       sampler_ms=round(alone[name, controlled], 3),
                       added_by_sampler=round((alone[name, controlled] - plain_sampler) / plain, 4))
                  for (name, controlled), t in ms.items()]
    if "host" in parts:
        host = [dict(case="plain", ms=host_ms(llm, prompt, args.rows, None))]
        host += [dict(case=name, ms=host_ms(llm, prompt, args.rows, extra)) for name, extra in cases.items()]
        host.append(dict(case="penalties, history from the token lists",
                         ms=host_ms(llm, prompt, args.rows, PENALTIES, from_lists=True)))
    import jax
    out = Path(args.out)
    # A run of one part keeps the other's figures from an earlier run into the same file.
    results = json.loads(out.read_text()) if out.exists() and parts != {"device", "host"} else {}
    results.update({"date": time.strftime("%Y-%m-%d"), "backend": jax.default_backend(), "rows": args.rows,
                    "context": args.context, "max_model_len": args.max_model_len,
                    "vocab_size": llm.config.vocab_size})
    results.update({k: v for k, v in (("decode", decode), ("host_batch", host), ("long_context_penalties", long))
                    if v})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if decode:
        print(f"decode step: {args.rows} rows of {args.context + 8} tokens, max_model_len {args.max_model_len}, "
              f"{jax.default_backend()}")
        print(f"{'case':24} {'controlled rows':>15} {'ms/step':>9} {'vs plain':>9} {'sampler ms':>11} "
              f"{'sampler adds':>13}")
        for d in decode:
            print(f"{d['case']:24} {d['rows_controlled']:15d} {d['step_ms']:9.2f} {d['vs_plain']:9.3f} "
                  f"{d['sampler_ms']:11.3f} {100 * d['added_by_sampler']:12.2f}%")
    if host:
        print(f"\nhost: row_sampling + build_batch, {args.rows} decode rows of {args.context + 8} tokens")
        print(f"{'case':42} {'median ms':>10} {'min ms':>8}")
        for h in host:
            print(f"{h['case']:42} {h['ms']['median']:10.3f} {h['ms']['min']:8.3f}")
    if long:
        print(f"\npenalties at long contexts, {args.rows} decode rows: batch + copy + sampler, no model")
        print(f"{'context':>8} {'case':8} {'ms':>9} {'vs plain':>9}")
        for d in long:
            print(f"{d['context']:8d} {d['case']:8} {d['ms']:9.3f} {d['vs_plain']:9.3f}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
