"""Tensor and data parallelism, and the multi-process step broadcast, on the default model over CPU devices.

    python scripts/bench_parallel.py [--layouts 1x1,3x1,1x2,3x2] [--batch 16] [--processes 3]
                                     [--out bench_results/parallel.json]

Layout TPxDP: tensor parallel size x data parallel size, in one process over forced CPU devices (XLA_FLAGS). For
each: decode throughput (--batch sequences of a 32-token prompt, 64 new tokens each, ignore_eos: generated tokens
/ wall time of the run after warm-up), time per engine step, weights and KV cache per device, and what one decode
step moves between devices (the compiled program's collectives, from its HLO). Then the same tensor-parallel run
over --processes processes of one device each (gloo between them), and what process 0's publishing of each step's
batch costs. CPU devices share one memory and the host's 2 cores: splitting does not add compute or bandwidth here,
so these figures show the overheads (communication, synchronisation, the broadcast), not the speed-ups an
accelerator mesh would give.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if "--worker" not in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.aot.collectives import collective_census  # noqa: E402
from jaxserve.parallel.mesh import bytes_per_device  # noqa: E402
from jaxserve.runner.batch_builder import Row, build_batch  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_batched_tokens=256, warmup=True)
NEW_TOKENS = 64


def prompts(batch, vocab=49152):
    return [{"prompt_token_ids": [(31 * i + 7 * j) % vocab for j in range(32)]} for i in range(batch)]


def timed_run(llm, batch):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    steps = llm.stats().steps
    start = time.perf_counter()
    llm.generate(prompts(batch), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return dict(tok_s=batch * NEW_TOKENS / seconds, ms_per_step=1e3 * seconds / (llm.stats().steps - steps))


def step_collectives(llm, batch):
    """What one decode step of `batch` rows moves between the devices of a group: kind -> (count, MB)."""
    r = llm.runner
    if r.mesh is None or r.mesh.shape["model"] == 1:
        return {}
    rows = [Row([1], 0, [1]) for _ in range(batch)]
    b = r.steps.put_batch(build_batch(rows, r.page_size, r.config.vocab_size, batch, batch, r.buckets.pages_per_row))
    census = collective_census(r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, b).compile().as_text())
    moved = {}
    for c in census:
        n, mb = moved.get(c.kind, (0, 0.0))
        moved[c.kind] = (n + 1, mb + c.bytes / 1e6)
    return moved


def bench_layout(tp, dp, batch):
    llm = LLM(tensor_parallel_size=tp, data_parallel_size=dp, max_num_seqs=batch, **ENGINE)
    timed_run(llm, batch)  # every bucket the run uses, compiled and touched once
    runs = [timed_run(llm, batch) for _ in range(3)]
    best = max(runs, key=lambda r: r["tok_s"])
    weights = max(bytes_per_device([c.runner.params for c in llm.replicas]).values())
    cache = max(bytes_per_device([c.runner.kv_cache for c in llm.replicas]).values())
    return dict(layout=f"{tp}x{dp}", tp=tp, dp=dp, processes=1, batch=batch, **best,
                weights_mb_per_device=weights / 1e6, kv_mb_per_device=cache / 1e6,
                collectives=step_collectives(llm, batch // dp))


def worker(args):
    """One process of the multi-process run (process 0 writes the figures)."""
    coordinator, n, i, out = args.worker
    llm = LLM(tensor_parallel_size=int(n), max_num_seqs=args.batch, coordinator_address=coordinator,
              num_processes=int(n), process_id=int(i), **ENGINE)
    llm.generate(prompts(args.batch), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    runs, channel = [], llm.processes.channel
    for _ in range(3):
        sent, seconds, count = channel.bytes_sent, channel.seconds_sending, channel._count
        run = llm.processes.run(lambda: timed_run(llm, args.batch))
        run.update(publish_ms_per_message=1e3 * (channel.seconds_sending - seconds) / max(1, channel._count - count),
                   publish_kb_per_message=(channel.bytes_sent - sent) / 1e3 / max(1, channel._count - count))
        runs.append(run)
    if llm.is_leader:
        Path(out).write_text(json.dumps(max(runs, key=lambda r: r["tok_s"])))


def bench_processes(n, batch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    out = Path(f"/tmp/bench_parallel_{os.getpid()}.json")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "JAXSERVE_COORDINATOR_SECRET": os.urandom(16).hex()}
    procs = [subprocess.Popen([sys.executable, __file__, "--batch", str(batch), "--worker", coordinator, str(n),
                               str(i), str(out)], env=env) for i in range(n)]
    if any(p.wait(timeout=1800) for p in procs):
        raise SystemExit("a worker process failed")
    return dict(layout=f"{n}x1", tp=n, dp=1, processes=n, batch=batch, **json.loads(out.read_text()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,3x1,1x2,3x2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--processes", type=int, default=3, help="0: skip the multi-process run")
    p.add_argument("--out", default="bench_results/parallel.json")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for layout in args.layouts.split(","):
        tp, dp = map(int, layout.split("x"))
        rows.append(bench_layout(tp, dp, args.batch))
        print(json.dumps(rows[-1]), flush=True)
    if args.processes:
        rows.append(bench_processes(args.processes, args.batch))
    print(f"\ndefault model, {args.batch} sequences x {NEW_TOKENS} new tokens, float32, CPU devices")
    print(f"{'TPxDP':>6} {'procs':>5} {'tok/s':>7} {'ms/step':>8} {'weights MB/dev':>15} {'KV MB/dev':>10}  "
          "decode step moves (per device)")
    for r in rows:
        moved = ", ".join(f"{n} {k} ({mb:.2f} MB)" for k, (n, mb) in r.get("collectives", {}).items())
        extra = (f"publish {r['publish_ms_per_message']:.2f} ms, {r['publish_kb_per_message']:.1f} KB per step"
                 if "publish_ms_per_message" in r else moved)
        print(f"{r['layout']:>6} {r['processes']:>5} {r['tok_s']:7.1f} {r['ms_per_step']:8.1f} "
              f"{r.get('weights_mb_per_device', float('nan')):15.1f} {r.get('kv_mb_per_device', float('nan')):10.1f}"
              f"  {extra}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(batch=args.batch, new_tokens=NEW_TOKENS, rows=rows), indent=1))


if __name__ == "__main__":
    main()
