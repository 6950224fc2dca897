"""Multi-LoRA step cost on the default model (XLA:CPU): a 64-row decode step and a 512-token prefill step with 0, 1,
4 and 8 adapters against the base step, for each way of computing the LoRA term (`jaxserve.model.lora`), and the
time to load an adapter.

    python scripts/bench_lora.py [--rank 16] [--repeats 7] [--methods gather,segmented,ragged]
                                 [--out bench_results/lora.json]

base: a runner without LoRA (the programs of an engine with enable_lora off). "0 adapters": LoRA on, every row
base. k adapters: max_loras 8 slots of rank --rank on all seven linear targets, rows spread over k of them round
robin. Decode: 64 rows of one token after 128 cached tokens each; prefill: 8 rows of 64 prompt tokens (so that 8
adapters fit). Each figure is the median of --repeats steps (dispatch, step, the copy back), timed round robin over
every configuration after one step each that compiles.
Load: load_adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors) + the runner's load_lora.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import machine  # noqa: E402

from jaxserve.buckets import Buckets  # noqa: E402
from jaxserve.lora.adapter import TARGETS, load_adapter, target_shapes  # noqa: E402
from jaxserve.lora.request import LoRARequest  # noqa: E402
from jaxserve.model import lora as delta  # noqa: E402
from jaxserve.model.families import LINEARS  # noqa: E402
from jaxserve.runner.batch_builder import Row  # noqa: E402
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from jaxserve.runner.steps import steps_for  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402

MAX_LORAS, PAGE = 8, 16
DECODE_ROWS, CACHED = 64, 128
PREFILL_ROWS, PREFILL_LEN = 8, 64
ADAPTERS = (0, 1, 4, 8)


def write_peft_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for the model: every target of every layer, random A and B."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(config.num_layers):
        for t, (n_in, n_out) in target_shapes(config).items():
            key = f"base_model.model.model.layers.{i}.{LINEARS[t]}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def runner_for(loaded, rank: int, lora: bool) -> ModelRunner:
    pages_per_row = (CACHED + PAGE) // PAGE
    rc = RunnerConfig(loaded.params["params"]["embed_tokens"].dtype, 1 + DECODE_ROWS * pages_per_row, PAGE,
                      Buckets.for_limits(DECODE_ROWS, PREFILL_ROWS * PREFILL_LEN, pages_per_row), DECODE_ROWS,
                      max_loras=MAX_LORAS if lora else 0, max_lora_rank=rank if lora else 0)
    return ModelRunner(loaded.config, loaded.params, rc)


def step_rows(kind: str, adapters: int) -> list[Row]:
    per_row = CACHED // PAGE + 1
    slot = (lambda i: i % adapters) if adapters else (lambda i: -1)
    if kind == "decode":
        return [Row([7], CACHED, list(range(1 + i * per_row, 1 + (i + 1) * per_row)), lora_slot=slot(i))
                for i in range(DECODE_ROWS)]
    return [Row(list(range(10, 10 + PREFILL_LEN)), 0, list(range(1 + i * per_row, 1 + (i + 1) * per_row)),
                lora_slot=slot(i)) for i in range(PREFILL_ROWS)]


def timed(runner: ModelRunner, rows: list[Row]) -> float:
    start = time.perf_counter()
    runner.fetch(runner.dispatch(rows))
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default=",".join(delta.METHODS))
    ap.add_argument("--kinds", default="decode,prefill")
    ap.add_argument("--out", default="bench_results/lora.json")
    args = ap.parse_args()
    methods, kinds = args.methods.split(","), args.kinds.split(",")
    loaded = load_model(None, np.float32)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": loaded.name, "rank": args.rank,
               "max_loras": MAX_LORAS, "decode_rows": DECODE_ROWS, "prefill_tokens": PREFILL_ROWS * PREFILL_LEN,
               "default_method": delta.METHOD}
    runners = {"base": runner_for(loaded, args.rank, lora=False)}
    default = delta.METHOD
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"a{i}" for i in range(MAX_LORAS)]
        for i, p in enumerate(paths):
            write_peft_adapter(p, loaded.config, args.rank, i)
        loads = []
        for method in methods:
            delta.METHOD = method  # read when a step is traced: each method's runner has its own Steps, traced now
            steps_for.cache_clear()
            runner = runners[method] = runner_for(loaded, args.rank, lora=True)
            for i, p in enumerate(paths):
                start = time.perf_counter()
                adapter = load_adapter(LoRARequest(f"a{i}", i + 1, str(p)), loaded.config, args.rank)
                read = time.perf_counter() - start
                runner.load_lora(i, adapter)
                jax.block_until_ready(runner.lora)
                loads.append((read, time.perf_counter() - start))
            for kind in kinds:
                timed(runner, step_rows(kind, MAX_LORAS))  # compiles (every adapter count shares the program)
        delta.METHOD = default
        for kind in kinds:
            timed(runners["base"], step_rows(kind, 0))
    results["load_s"] = {"read": statistics.median(r for r, _ in loads[1:]),
                         "read_and_slot": statistics.median(t for _, t in loads[1:]), "adapter_bytes": adapter.nbytes}
    # Round robin over every configuration, so that the load of a shared machine falls on all alike.
    cases = [(kind, "base", 0) for kind in kinds] + [(kind, m, k) for kind in kinds for m in methods for k in ADAPTERS]
    times = {c: [] for c in cases}
    for r in range(args.repeats):
        for kind, name, k in cases:
            times[kind, name, k].append(timed(runners[name], step_rows(kind, k)))
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    med = {c: statistics.median(t) for c, t in times.items()}
    results["steps_s"] = {f"{kind} {name} {k}": t for (kind, name, k), t in med.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\n{loaded.name}, rank {args.rank}, {MAX_LORAS} slots, XLA:CPU ({results['machine']['cpu']}, "
          f"{results['machine']['cores']} cores): median of {args.repeats} steps, ms (x base)")
    head = "".join(f"{f'{k} adapters':>17}" for k in ADAPTERS)
    for kind in kinds:
        what = f"decode, {DECODE_ROWS} rows" if kind == "decode" else f"prefill, {PREFILL_ROWS * PREFILL_LEN} tokens"
        base = med[kind, "base", 0]
        print(f"\n{what}: base {1e3 * base:.1f} ms")
        print(f"{'method':<12}{head}")
        for m in methods:
            print(f"{m:<12}" + "".join(f"{1e3 * med[kind, m, k]:>9.1f} ({med[kind, m, k] / base:4.2f}x)"
                                       for k in ADAPTERS))
    load = results["load_s"]
    print(f"\nadapter load ({load['adapter_bytes'] / 1e6:.1f} MB float32): read {1e3 * load['read']:.0f} ms, "
          f"read + slot {1e3 * load['read_and_slot']:.0f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
