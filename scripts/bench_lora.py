"""Multi-LoRA step cost on the default model (XLA:CPU): a 64-row decode step, a 512-token prefill step of 8 rows and
one of a single 512-token sequence, with 0, 1, 4 and 8 adapters against the base step, for each way of computing the
LoRA term (`jaxserve.model.lora`), and the time to load an adapter.

    python scripts/bench_lora.py [--rank 16] [--repeats 5] [--methods segmented,sorted,gather,ragged]
                                 [--kinds decode,prefill,prefill1] [--out bench_results/lora.json]

base: a runner without LoRA (the programs of an engine with enable_lora off). "0 adapters": LoRA on, every slot
holding an adapter, every row on the base model (the runner then runs the base model's program). k adapters:
max_loras 8 slots of rank --rank on all seven linear targets, rows spread over k of them round robin. Decode: 64
rows of one token after 128 cached tokens each; prefill: 8 rows of 64 prompt tokens (so that 8 adapters fit);
prefill1: one sequence's 512-token chunk (the common case: one adapter). Each figure is the median of --repeats
steps (dispatch, step, the copy back), timed round robin over every configuration after one step each that
compiles, so that the load of a shared machine falls on all alike.
Load: load_adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors), the slot's padded host
arrays (`slot_arrays`, what the engine thread no longer builds) and the runner's load_lora.
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
from jaxserve.lora.buffers import slot_arrays  # noqa: E402
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
ADAPTERS = {"decode": (0, 1, 4, 8), "prefill": (0, 1, 4, 8), "prefill1": (0, 1)}


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
    pages_per_row = (PREFILL_ROWS * PREFILL_LEN + PAGE) // PAGE  # prefill1's one row
    num_pages = 1 + DECODE_ROWS * ((CACHED + PAGE) // PAGE)
    rc = RunnerConfig(loaded.params["params"]["embed_tokens"].dtype, num_pages, PAGE,
                      Buckets.for_limits(DECODE_ROWS, PREFILL_ROWS * PREFILL_LEN, pages_per_row), DECODE_ROWS,
                      max_loras=MAX_LORAS if lora else 0, max_lora_rank=rank if lora else 0)
    return ModelRunner(loaded.config, loaded.params, rc)


def step_rows(kind: str, adapters: int) -> list[Row]:
    per_row = CACHED // PAGE + 1
    slot = (lambda i: i % adapters) if adapters else (lambda i: -1)
    if kind == "decode":
        return [Row([7], CACHED, list(range(1 + i * per_row, 1 + (i + 1) * per_row)), lora_slot=slot(i))
                for i in range(DECODE_ROWS)]
    if kind == "prefill1":
        n = PREFILL_ROWS * PREFILL_LEN
        return [Row([10 + i % 1000 for i in range(n)], 0, list(range(1, 2 + n // PAGE)), lora_slot=slot(0))]
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
    ap.add_argument("--methods", default="segmented,sorted")
    ap.add_argument("--kinds", default="decode,prefill,prefill1")
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
                slot_arrays(adapter, loaded.config, args.rank, runner.dtype)
                build = time.perf_counter() - start - read
                runner.load_lora(i, adapter)
                jax.block_until_ready(runner.lora)
                loads.append((read, build, time.perf_counter() - start))
            for kind in kinds:  # compiles: every adapter count shares the LoRA program, 0 runs the base model's
                timed(runner, step_rows(kind, MAX_LORAS))
                timed(runner, step_rows(kind, 0))
        delta.METHOD = default
        for kind in kinds:
            timed(runners["base"], step_rows(kind, 0))
    results["load_s"] = {"read": statistics.median(r for r, _, _ in loads[1:]),
                         "slot_arrays": statistics.median(b for _, b, _ in loads[1:]),
                         "read_and_slot": statistics.median(t for _, _, t in loads[1:]),
                         "adapter_bytes": adapter.nbytes}
    # Round robin over every configuration, so that the load of a shared machine falls on all alike. 0 adapters runs
    # the base model's program whatever the method: timed once, on the first method's runner.
    cases = [(kind, "base", 0) for kind in kinds] + [(kind, m, k) for kind in kinds for m in methods
                                                     for k in ADAPTERS[kind] if k or m == methods[0]]
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
    whats = {"decode": f"decode, {DECODE_ROWS} rows", "prefill": f"prefill, {PREFILL_ROWS} rows x {PREFILL_LEN}",
             "prefill1": f"prefill, one sequence of {PREFILL_ROWS * PREFILL_LEN} tokens"}
    for kind in kinds:
        base = med[kind, "base", 0]
        print(f"\n{whats[kind]}: base {1e3 * base:.1f} ms")
        print(f"{'method':<12}" + "".join(f"{f'{k} adapters':>17}" for k in ADAPTERS[kind]))
        for m in methods:
            print(f"{m:<12}" + "".join(f"{1e3 * med[kind, n, k]:>9.1f} ({med[kind, n, k] / base:4.2f}x)"
                                       for k in ADAPTERS[kind] for n in [m if k else methods[0]]))
    load = results["load_s"]
    print(f"\nadapter load ({load['adapter_bytes'] / 1e6:.1f} MB float32): read {1e3 * load['read']:.0f} ms, "
          f"padded slot arrays {1e3 * load['slot_arrays']:.0f} ms, "
          f"read + arrays + slot {1e3 * load['read_and_slot']:.0f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
