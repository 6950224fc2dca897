"""Where one engine step spends its time, by careful isolation: the whole step, and each part compiled alone at the
same shapes (the model with attention replaced by nothing, attention alone, the LM head and sampling, the cache
write), plus the host's work (batch building, the copies), and the engine loop's host share at batch 64. XLA:CPU.

    python scripts/profile_step.py [--model gemma3-270m] [--quantization int8] [--cases b1,b8,b64,chunk512]
                                   [--context 512] [--host-batch 64 | 0] [--out bench_results/profile.json]

bN: a decode step of N rows, each after `--context` cached tokens. chunkN: one N-token prompt chunk, nothing
cached. Each time is the median of --repeats runs of a compiled program on device-resident inputs. The params are
the ones the engine's runner serves (`model_runner.served_params`: fused projections on CPU, its LM head).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine, timed  # noqa: E402

from jaxserve.cache import init_kv_cache, pages_needed  # noqa: E402
from jaxserve.model import attention as attention_module  # noqa: E402
from jaxserve.model.decoder import DecoderModel  # noqa: E402
from jaxserve.model.quant import matmul  # noqa: E402
from jaxserve.quantize.apply import quantize_model  # noqa: E402
from jaxserve.runner.batch_builder import Row, build_batch  # noqa: E402
from jaxserve.runner.model_runner import served_params  # noqa: E402
from jaxserve.runner.steps import Steps, write_cache  # noqa: E402
from jaxserve.sample.sampling import sample  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402


def case_rows(case: str, context: int, page_size: int, vocab: int):
    rng = np.random.default_rng(0)
    if case.startswith("chunk"):
        n = int(case[5:])
        return [Row(rng.integers(100, vocab, n).tolist(), 0, list(range(1, 1 + pages_needed(n, page_size))))]
    b, per = int(case[1:]), pages_needed(context + 1, page_size)
    return [Row([int(rng.integers(100, vocab))], context, list(range(1 + i * per, 1 + (i + 1) * per)))
            for i in range(b)]


def profile(case, model, context, page_size, repeats):
    config = model.config
    params = served_params(config, model.params, jax.devices()[0].platform)  # as the engine's runner serves them
    rows = case_rows(case, context, page_size, config.vocab_size)
    T = sum(len(r.token_ids) for r in rows)
    S = len(rows)
    pages = pages_needed(max(context, T) + 1, page_size)
    t = time.perf_counter()
    for _ in range(repeats):
        batch = build_batch(rows, page_size, config.vocab_size, T, S, pages)
    host_build = (time.perf_counter() - t) / repeats * 1e3
    device_batch = jax.block_until_ready(jax.device_put(batch))  # the programs below time on device inputs
    kv = init_kv_cache(config, 1 + S * pages, page_size, jnp.float32)
    steps = Steps(config, jnp.float32)
    steps.put_batch(batch)  # its constants' one copy
    t = time.perf_counter()
    jax.block_until_ready(steps.put_batch(batch))  # what a step does to its inputs before its calls copy the rest
    copy_in = (time.perf_counter() - t) * 1e3
    last = jnp.zeros(S + 1, jnp.int32)

    out = {}

    def whole():
        nonlocal kv, last
        o, kv, last = steps.step(params, kv, last, device_batch)
        return o.tokens

    out["step (forward + write)"] = timed(whole, repeats)
    # The forward program as the step runs it (sampling, the prompt scorer's loop) against the model alone below:
    # what a step costs beyond its forward when no row asks for logprobs.
    def forward_program():
        nonlocal kv, last
        o, written, last, _ = steps._forward(params, kv, last, device_batch, None)  # last_tokens donated
        if steps.writes_in_forward:  # on one CPU device the program writes the cache too, donated
            kv = written
        return o.tokens

    out["step's forward program (+ sampling, scorer)"] = timed(forward_program, repeats)
    forward = jax.jit(lambda p, kv, b: DecoderModel(config, jnp.float32).apply(p, b.token_ids, kv, b.rows,
                                                                            b.logits_index))
    out["forward"] = timed(lambda: forward(params, kv, device_batch)[0], repeats)
    real_attention = attention_module.ragged_attention
    attention_module.ragged_attention = lambda q, k, v, *a, **kw: q  # shapes kept, no attention work
    try:
        no_attention = jax.jit(lambda p, kv, b: DecoderModel(config, jnp.float32).apply(
            p, b.token_ids, kv, b.rows, b.logits_index))
        out["forward without attention"] = timed(lambda: no_attention(params, kv, device_batch)[0], repeats)
    finally:
        attention_module.ragged_attention = real_attention
    H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
    q = jnp.asarray(np.random.default_rng(1).normal(size=(T, H, D)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(2).normal(size=(T, KVH, D)), jnp.float32)
    one_layer = jax.jit(lambda q, k, kv, b: real_attention(q, k, k, kv[0][0], kv[0][1], b.rows))
    out["attention (all layers)"] = timed(lambda: one_layer(q, k, kv, device_batch), repeats) * config.num_layers
    head = params["params"]["lm_head"]["kernel"]
    x = jnp.ones((S, config.hidden_size), jnp.float32)
    head_and_sample = jax.jit(lambda x, w, s: sample(matmul(x, w).astype(jnp.float32), s))
    out["lm head + sampling"] = timed(lambda: head_and_sample(x, head, device_batch.sampling).tokens, repeats)
    new_kv = [(k, k)] * config.num_layers
    write = jax.jit(write_cache, donate_argnums=0)

    def written():
        nonlocal kv
        kv = write(kv, new_kv, device_batch.slot_mapping)
        return kv[0][0]

    out["cache write"] = timed(written, repeats)
    o, kv, last = steps.step(params, kv, last, device_batch)
    jax.block_until_ready(o)
    t = time.perf_counter()
    jax.device_get(o)
    out["copy back"] = (time.perf_counter() - t) * 1e3
    dispatches = []
    for _ in range(repeats):  # the host's side of a step on an idle device: put_batch and two program calls
        jax.block_until_ready((kv, last))
        t = time.perf_counter()
        o, kv, last = steps.step(params, kv, last, batch)
        dispatches.append(time.perf_counter() - t)
        jax.block_until_ready((o, kv))
    dispatch = statistics.median(dispatches) * 1e3
    out["host: build batch"] = host_build
    out["host: put_batch"] = copy_in
    out["host: dispatch (put_batch, 2 program calls)"] = dispatch
    out["matmul GFLOP (2 x params x tokens)"] = 2 * T * sum(
        x.size for name, x in jax.tree_util.tree_leaves_with_path(params["params"])
        if "embed" not in jax.tree_util.keystr(name)) / 1e9
    return {"case": case, "tokens": T, "rows": S, "ms": {k: round(v, 2) for k, v in out.items()}}


def host_loop(batch: int, steps: int = 20, temperature: float = 0.8, model=None, quantization=None) -> dict:
    """The engine loop at `batch` decoding sequences: time per step, and of it the host's own work (planning,
    batch building, dispatch, reading back, detokenizing, stop checks) as opposed to waiting for the device."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.batching.sequence import Sequence
    llm = LLM(model, max_model_len=1024, max_num_seqs=batch, max_num_batched_tokens=512, warmup=False,
              quantization=quantization)
    core, runner = llm.core, llm.runner
    prompt = np.random.default_rng(0).integers(100, llm.config.vocab_size, 64).tolist()
    params = SamplingParams(temperature=temperature, top_p=0.95, seed=0, max_tokens=10 * steps, ignore_eos=True)
    for i in range(batch):
        detok = llm._request({"prompt_token_ids": prompt}, params).seqs[0].output.detokenizer
        core.add(Sequence(f"h{i}", 0, prompt, params, i, llm.max_model_len, [], detok))
    for _ in range(steps):  # prefill, compile the decode bucket
        core.step()
    waited = []
    fetch = runner.fetch

    def timed_fetch(handle):
        t = time.perf_counter()
        jax.block_until_ready(handle.output)
        waited.append(time.perf_counter() - t)
        return fetch(handle)
    runner.fetch = timed_fetch
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = (time.perf_counter() - t) / steps
    wait = statistics.mean(waited[-steps:])
    return {"batch": batch, "step_ms": round(total * 1e3, 2), "host_ms": round((total - wait) * 1e3, 2),
            "host_share": round((total - wait) / total, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a known name or path (default: the default model)")
    ap.add_argument("--quantization", default=None, help="e.g. int8 (default: none)")
    ap.add_argument("--cases", default="b1,b8,b64,chunk512")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host-batch", type=int, default=64,
                    help="decoding sequences for the host-loop measurement (0: skip it)")
    ap.add_argument("--host-temperature", type=float, default=0.8, help="0: greedy (top_p then unused)")
    ap.add_argument("--out", default="bench_results/profile.json")
    args = ap.parse_args()
    model = quantize_model(load_model(args.model, jnp.float32), args.quantization)
    results = [profile(c, model, args.context, 16, args.repeats) for c in args.cases.split(",")]
    loop = (host_loop(args.host_batch, temperature=args.host_temperature, model=args.model,
                      quantization=args.quantization) if args.host_batch else None)
    keys = list(results[0]["ms"])
    print(f"{'ms per step':<46}" + "".join(f"{r['case']:>11}" for r in results))
    for key in keys:
        print(f"{key:<46}" + "".join(f"{r['ms'][key]:>11.2f}" for r in results))
    if loop:
        print(f"\nengine loop at {loop['batch']} decoding sequences (temperature {args.host_temperature}, "
              f"detokenizing): {loop['step_ms']} ms per step, host work per step {loop['host_ms']} ms "
              f"({100 * loop['host_share']:.1f}%)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": model.name,
                               "quantization": args.quantization, "context": args.context,
                               "results": results, "host_loop": loop}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
