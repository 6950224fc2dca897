"""Decode and prefill speed of jaxserve on the default model, beside llama.cpp and HF transformers in the same run.

    python scripts/bench_decode.py [--batch-sizes 1,8,32,64] [--formats float32,int8,int4,int8-kv]
                                   [--format-batch-sizes 1,8] [--peers llamacpp,hf] [--out bench_results/decode.json]

jaxserve: decode tok/s = B x steps / time of `steps` engine decode steps with B sequences after a 512-token prompt
(host loop included: batch building, the step, the one device-to-host copy, stop checks); prefill tok/s = tokens /
time of one 512-token prefill step. Peers come from scripts/peers.py. The table ends with the memory-bandwidth floor:
a batch-1 decode step reads every weight once, so tok/s <= bandwidth / weight bytes; it also reads its sequence's
KV cache (every layer's keys and values of its context: the 512-token prompt and what the runs decoded after it;
~5-6% of the weights' bytes for the default model in float32), so the floor of every byte it reads is bandwidth /
(weight + KV bytes), each batch-1 run at its own mean context.
--formats adds a row per weight / KV-cache format (quantized weights, int8 KV pages), at --format-batch-sizes.

Beside each format's batch-1 figure, its step's weight dots alone (`weight_dots_ms`): one row through every linear
weight the runner serves, as a decode step chains them, with nothing else (no attention, sampling or host work), so
a step's time splits into the reading of its weights (on CPU, up to its row limits, by the few-row kernel of
jaxserve.cpu_kernels, which matmul calls from XLA:CPU's program) and the rest.

Two bandwidths set the floor: the probe's (scripts/peers.py, numpy, before anything runs) and XLA's own read rate
(a one-row float32 dot over 512 MB, as a decode step's), sampled before each of jaxserve's decode runs, so that it
sees the load the decode saw. On the 2 vCPU machine numpy's probe reads at about one core's rate (~16-18 GB/s,
one thread or two), XLA on both cores up to ~31 GB/s when nothing else runs: a decode can beat the probe's floor.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.batching.sequence import Sequence  # noqa: E402
from jaxserve.cache.transfer import kv_bytes, num_pages  # noqa: E402
from jaxserve.model.quant import Int4Weight, Int8Weight, is_quantized, matmul  # noqa: E402
from jaxserve.runner.batch_builder import Row  # noqa: E402
from jaxserve.weights import resolve_model_path  # noqa: E402
from jaxserve.weights.params import param_bytes  # noqa: E402

# name: LLM options. Weights: linear layers quantized (the embeddings stay float32, and the LM head unless the runner
# makes it int8: on CPU for an int8 model with a large vocabulary, `model_runner.with_serving_head`);
# bfloat16: every parameter, activation and KV page in bf16.
FORMATS = {"float32": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
           "awq": {"quantization": "awq"}, "int8-kv": {"kv_cache_dtype": "int8"}, "bfloat16": {"dtype": "bfloat16"}}


class XlaReadProbe:
    """XLA's read bandwidth: a one-row float32 dot over an array of `mb` MB (every byte read once, on every core XLA
    uses), the way a batch-1 decode step reads its weights."""

    def __init__(self, mb: int = 512):
        self.weights = jnp.full((1024, mb * 2**20 // 4096), 0.5, jnp.float32)  # [1024, N]
        self.row = jnp.ones((1, 1024), jnp.float32)
        self.dot = jax.jit(lambda x, w: x @ w)
        jax.block_until_ready(self.dot(self.row, self.weights))  # compile
        self.samples: list[float] = []  # GB/s

    def sample(self, runs: int = 3) -> None:
        """Adds the fastest of `runs` reads (a run slowed by another process is not the machine's rate)."""
        best = float("inf")
        for _ in range(runs):
            t = time.perf_counter()
            jax.block_until_ready(self.dot(self.row, self.weights))
            best = min(best, time.perf_counter() - t)
        self.samples.append(self.weights.nbytes / best / 1e9)

    def take(self) -> list[float]:
        samples, self.samples = self.samples, []
        return samples


def timed(fn, repeats: int) -> float:
    """Median ms of fn() over `repeats` runs, after one that compiles it."""
    jax.block_until_ready(fn())
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


def weight_dots_ms(params, dtype, repeats: int = 15) -> float:
    """ms of one row through every linear weight of params (each leaf named kernel, quantized or not, the LM head
    included; not the embedding table, of which a step reads one row), each dot's output feeding the next as a
    decode step's do, RMS-normalized in between as the model's norms would (the values stay finite): what the
    dots of a batch-1 step cost in this format, the part of the step that reads its weights."""
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params["params"], is_leaf=is_quantized)
               if jax.tree_util.keystr(path[-1:]) == "['kernel']"]

    def in_dim(w):  # an int4 kernel takes its padded input rows (zeros past the float kernel's)
        return 2 * w.packed.shape[0] if isinstance(w, Int4Weight) else (
            w.values if isinstance(w, Int8Weight) else w).shape[0]

    def chain(kernels, x):  # x [1, in]
        for w in kernels:
            n = in_dim(w)
            x = x[:, :n] if x.shape[1] >= n else jnp.pad(x, ((0, 0), (0, n - x.shape[1])))
            x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32))) + 1e-6).astype(x.dtype)
            x = matmul(x, w)
        return x

    run = jax.jit(chain)
    x = jnp.ones((1, in_dim(kernels[0])), dtype)
    return timed(lambda: run(kernels, x), repeats)


def kv_read_bytes(runner, context: int) -> int:
    """Bytes of KV cache a batch-1 decode step at `context` tokens reads: each layer's keys and values (and their
    scales, for int8 pages) of the tokens its attention sees (a sliding layer: its window's; the CPU kernel skips
    the pages before it)."""
    tokens = num_pages(runner.kv_cache) * runner.page_size
    per_token = [kv_bytes(layer) // tokens for layer in runner.kv_cache]  # [layers]
    windows = [runner.config.layer_window(i) for i in range(len(per_token))]
    return sum(b * (context if w is None else min(context, w)) for b, w in zip(per_token, windows))


def bench_jaxserve(batch_sizes, fmt="float32", prompt_len=512, decode_steps=32, repeats=3, model=None, probe=None):
    llm = LLM(model, max_model_len=1024, max_num_seqs=max(batch_sizes), max_num_batched_tokens=prompt_len, warmup=False,
              **FORMATS[fmt])
    core, runner = llm.core, llm.runner
    prompt = peers._prompt_ids(prompt_len, llm.config.vocab_size)

    def prefill_time():
        row = Row(prompt, 0, list(range(1, 1 + prompt_len // runner.page_size)))
        t = time.perf_counter()
        runner.fetch(runner.dispatch([row]))
        return time.perf_counter() - t

    prefill_time()  # compile
    prefill = statistics.median(prefill_time() for _ in range(repeats))

    weight_bytes = param_bytes(runner.params) - param_bytes(runner.params["params"]["embed_tokens"])
    decode, paired, paired_kv, kv_read = {}, [], [], []
    for b in batch_sizes:
        params = SamplingParams(temperature=0, max_tokens=decode_steps * (repeats + 1) + 2, ignore_eos=True)
        # Every sequence decodes after the same 512-token prompt, as in the peers' decode figures.
        for i in range(b):
            core.add(Sequence(f"b{b}-{i}", 0, prompt, params, 0, llm.max_model_len, []))
        while any(s.num_to_compute > 1 for s in llm.scheduler.running) or llm.scheduler.waiting:
            core.step()
        core.step()  # compile this batch's decode bucket
        runs = []
        for _ in range(repeats):
            if probe is not None:
                probe.sample()
            first = llm.scheduler.running[0].num_tokens
            t = time.perf_counter()
            for _ in range(decode_steps):
                core.step()
            runs.append(b * decode_steps / (time.perf_counter() - t))
            if b == 1:  # this run against the floor at the rate XLA read just before it
                kv_read.append(kv_read_bytes(runner, (first + llm.scheduler.running[0].num_tokens) // 2))
                if probe is not None:
                    floor = probe.samples[-1] * 1e9  # bytes/s
                    paired.append(runs[-1] / (floor / weight_bytes))
                    paired_kv.append(runs[-1] / (floor / (weight_bytes + kv_read[-1])))
        decode[b] = round(statistics.median(runs), 1)
        for s in list(llm.scheduler.running):
            core.abort(s.request_id)
        while core.has_unfinished():
            core.step()
    return {"engine": f"jaxserve ({fmt}, XLA:CPU)", "format": fmt, "prefill_tok_s": round(prompt_len / prefill, 1),
            # Bytes a decode step reads: every weight but the embedding table, of which it reads only B rows.
            "decode_tok_s": decode, "param_bytes": param_bytes(runner.params),
            "weight_bytes": weight_bytes,
            # Bytes of KV cache a batch-1 step read besides its weights, at the runs' mean context (mean over runs).
            "kv_read_bytes_b1": round(statistics.mean(kv_read)) if kv_read else None,
            "prompt_len": prompt_len,
            "compiled_programs": runner.steps.num_compiled(),
            "weight_dots_ms": round(weight_dots_ms(runner.params, runner.steps.model.dtype), 2),
            # XLA's read rate sampled between this engine's decode runs (max: the rate the machine allowed).
            "xla_read_GBps": round(max(probe.take()), 1) if probe is not None else None,
            # Each batch-1 run over the floor at the rate of XLA's read just before it (the host's speed moves
            # between minutes: a run and its own probe see the same machine), median over the runs.
            "b1_of_xla_floor_paired": round(statistics.median(paired), 3) if paired else None,
            # The same against the floor of every byte a step reads: its weights and its KV cache.
            "b1_of_xla_floor_paired_with_kv": round(statistics.median(paired_kv), 3) if paired_kv else None}


def machine() -> dict:
    import os
    import platform

    import jax
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF or a known name (default: the default model; e.g. "
                                                  "gemma3-270m); the peers run the same GGUF")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--formats", default="float32,int8,int4,int8-kv", help="comma list of " + ", ".join(FORMATS))
    ap.add_argument("--format-batch-sizes", default="1,8", help="batch sizes for the formats other than float32")
    ap.add_argument("--peers", default="llamacpp,hf", help="comma list of llamacpp, hf (empty or none: none)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the figure is their median)")
    ap.add_argument("--out", default="bench_results/decode.json")
    args = ap.parse_args()
    bs = tuple(int(b) for b in args.batch_sizes.split(","))
    gguf = resolve_model_path(args.model)
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        ap.error(f"unknown formats {sorted(unknown)}")
    fbs = tuple(int(b) for b in args.format_batch_sizes.split(","))
    which = [p for p in args.peers.split(",") if p and p != "none"]
    if unknown := set(which) - {"llamacpp", "hf"}:  # refused before the minutes of jaxserve's own runs
        ap.error(f"unknown peers {sorted(unknown)}")
    probe = XlaReadProbe()
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
               "bandwidth": peers.measure_bandwidth(), "model": gguf.name,
               "jaxserve": bench_jaxserve(bs, repeats=args.repeats, model=args.model, probe=probe),
               "formats": [bench_jaxserve(fbs, f, repeats=args.repeats, model=args.model, probe=probe)
                           for f in formats if f != "float32"]}
    if "llamacpp" in which:
        results["llamacpp"] = peers.bench_llamacpp(str(gguf), batch_sizes=bs)
    if "hf" in which:
        results["hf"] = peers.bench_hf(str(gguf.parent), gguf.name, batch_sizes=bs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    rows = [results[k] for k in ("jaxserve", "llamacpp", "hf") if k in results] + results["formats"]
    peers._table(rows, bs)
    bw = results["bandwidth"]["read_GBps"] * 1e9
    print(f"\nmemory bandwidth (read): {bw / 1e9:.1f} GB/s (probe); XLA's one-row dot between the decode runs: "
          "see each row")
    for r in rows:
        floor = bw / r["weight_bytes"]
        got = r["decode_tok_s"].get(1, float("nan"))
        line = (f"{r['engine'][:40]:<40} {r['weight_bytes'] / 1e6:6.0f} MB weights/step -> batch-1 floor "
                f"{floor:5.0f} tok/s; measured {got:5.1f} ({100 * got / floor:3.0f}% of floor)")
        if r.get("xla_read_GBps"):
            xla_floor = r["xla_read_GBps"] * 1e9 / r["weight_bytes"]
            line += (f"; at XLA's {r['xla_read_GBps']:.1f} GB/s floor {xla_floor:5.0f} tok/s "
                     f"({100 * got / xla_floor:3.0f}%)")
        if r.get("b1_of_xla_floor_paired"):
            line += f"; each run against XLA's read just before it: {100 * r['b1_of_xla_floor_paired']:3.0f}% (median)"
        if r.get("b1_of_xla_floor_paired_with_kv"):
            line += (f"\n{'':40} with the {r['kv_read_bytes_b1'] / 1e6:.0f} MB of KV cache a step reads too: "
                     f"{100 * r['b1_of_xla_floor_paired_with_kv']:3.0f}% of that floor (paired, median)")
        if r.get("weight_dots_ms"):
            dots = r["weight_dots_ms"]
            line += (f"\n{'':40} its dots alone {dots:.1f} ms a step ({r['weight_bytes'] / dots / 1e6:.1f} GB/s), "
                     f"{100 * dots * got / 1e3:3.0f}% of its batch-1 step")
        print(line)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
