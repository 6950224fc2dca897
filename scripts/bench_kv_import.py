"""What one KV import costs a decode server's engine thread, before and after issue 53 moved its staging to the KV
import thread, alternating in one process.

    taskset -c 1 python scripts/bench_kv_import.py [--prompt-lens 1024,1400,2048] [--repeats 7]
        [--out scripts/bench_results/kv_import.json]

The pages are the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32, 16-token pages) for
a prompt of each length, as numpy arrays fresh from the wire (`fetch_pages`), into a cache of --max-model-len 2560's
page buckets. The code is ModelRunner's own (`put_pages`, `import_pages`) and kv_handoff's, over a stand-in runner
that holds only a cache (no model):
- before: the engine thread ran `copy_in` on the wire's arrays (padding to the page bucket, device_put) when it took
  the request in, then the import's scatter before the step (`write_imports`);
- after: the import thread has run `staged` (the same copy, waited for) before the engine thread sees the request;
  the engine thread's `copy_in` finds the pages in place, then the same scatter.
engine ms: the median of --repeats of the engine thread's part, each waited for (the scatter runs on the device
before the next step, so it counts); staging ms: what the import thread now does instead (off the engine thread).
Prints a table; writes JSON.
"""
import argparse
import json
import statistics
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batching.kv_handoff import copy_in, staged
from jaxserve.buckets import geometric
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import scatter_pages
from jaxserve.runner.model_runner import ModelRunner

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16
MAX_MODEL_LEN = 2560


def stand_in_runner(num_pages: int):
    """A ModelRunner's page-moving parts over an empty cache: put_pages and import_pages as they are."""
    r = types.SimpleNamespace(mesh=None, page_buckets=geometric(1, pages_needed(MAX_MODEL_LEN, PAGE)))
    r.kv_cache = [tuple(jnp.zeros((num_pages, KV_HEADS, PAGE, HEAD_DIM)) for _ in range(2)) for _ in range(LAYERS)]
    r._scatter = jax.jit(scatter_pages, donate_argnums=0)
    r.put_pages = types.MethodType(ModelRunner.put_pages, r)
    r.import_pages = types.MethodType(ModelRunner.import_pages, r)
    return r


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(prompt_len: int, repeats: int) -> dict:
    n = pages_needed(prompt_len, PAGE)
    runner = stand_in_runner(2 * pages_needed(MAX_MODEL_LEN, PAGE) + 1)
    rng = np.random.default_rng(prompt_len)
    wire = [tuple(rng.standard_normal((n, KV_HEADS, PAGE, HEAD_DIM), np.float32) for _ in range(2))
            for _ in range(LAYERS)]
    seq = types.SimpleNamespace(request_id="bench")
    ids = list(range(1, n + 1))

    def engine(kv):  # add_prefilled's copy, then the import before the step, waited for
        runner.import_pages(ids, copy_in(runner, seq, kv, prompt_len, PAGE))
        jax.block_until_ready(runner.kv_cache)

    engine(wire)
    engine(staged(runner, seq, wire, prompt_len, PAGE))  # compiled both ways
    before, after, staging = [], [], []
    for _ in range(repeats):  # alternating
        before.append(timed(lambda: engine(wire)))
        kv = []
        staging.append(timed(lambda: kv.append(staged(runner, seq, wire, prompt_len, PAGE))))
        after.append(timed(lambda: engine(kv[0])))
    b, a = statistics.median(before), statistics.median(after)
    return {"prompt_tokens": prompt_len, "mb": round(sum(x.nbytes for p in wire for x in p) / 1e6, 1),
            "engine_ms_before": round(b * 1e3, 2), "engine_ms_after": round(a * 1e3, 2),
            "before_over_after": round(b / a, 1), "staging_ms_on_import_thread": round(
                statistics.median(staging) * 1e3, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 1400, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="scripts/bench_results/kv_import.json")
    args = ap.parse_args()
    rows = [measure(n, args.repeats) for n in args.prompt_lens]
    print(f"{'prompt':>7}{'MB':>7}{'engine ms before':>18}{'after':>8}{'ratio':>8}{'import thread ms':>18}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7}{r['mb']:>7}{r['engine_ms_before']:>18}{r['engine_ms_after']:>8}"
              f"{r['before_over_after']:>7}x{r['staging_ms_on_import_thread']:>18}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
