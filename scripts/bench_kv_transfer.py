"""Cost of moving one request's KV pages from a prefill side to a decode side, per path (issue 26).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_kv_transfer.py \
        [--prompt-lens 1024,8192] [--kv-dtypes float32,int8] [--repeats 5]
        [--out scripts/bench_results/kv_transfer.json]

The pages are the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64) for a prompt of each length,
page size 16, starting as jax arrays on the first CPU device (as `ModelRunner.export_pages` leaves them). Paths:
- device_put: `jax.device_put` to the second CPU device of this process (the one-host pools' path);
- socket: a KVServer and `fetch_pages` over loopback TCP in one event loop (encode: device-to-host copy and crc32;
  send; receive; decode: crc32), ending in numpy arrays on the decode side (import_pages then puts them on its
  devices, not timed here); encode and decode alone are timed too;
- jax.transfer: the same fetch with a JaxTransferEndpoint on each side (two transfer servers in this process, over
  loopback sockets), ending in jax arrays on the second device;
- socket x-proc, jax x-proc: the same two fetches from a KVServer in a child process (its own GIL and event loop,
  as a prefill server has), the child putting fresh pages for each.
ms: the median of --repeats requests after one warm-up request; loop stall: the longest a 1 ms timer in the
event loop waited beyond its time during the fetches (both server and client run in it: what a server's other
requests would wait). Prints a table; writes JSON.
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.cache.kv_cache import Int8Pages
from jaxserve.kv_transfer import (
    JaxTransferEndpoint,
    KVServer,
    KVStore,
    KVTransferError,
    decode_pages,
    encode_pages,
    fetch_pages,
)

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16  # SmolLM2-135M, the default model
HOST = "127.0.0.1"


def make_pages(prompt_len: int, kv_dtype: str, device) -> list:
    """A request's KVPages on device: per layer (k, v), each [pages, kv_heads, page_size, head_dim] (or Int8Pages)."""
    shape = (-(-prompt_len // PAGE_SIZE), KV_HEADS, PAGE_SIZE, HEAD_DIM)
    key = jax.random.key(prompt_len)

    def pages(key):
        if kv_dtype == "int8":
            return Int8Pages(jax.random.randint(key, shape, -127, 128, jnp.int8),
                             jax.random.uniform(key, shape[:-1], jnp.float32))
        return jax.random.normal(key, shape, jnp.dtype(kv_dtype))
    kv = [(pages(jax.random.fold_in(key, 2 * i)), pages(jax.random.fold_in(key, 2 * i + 1))) for i in range(LAYERS)]
    return jax.block_until_ready(jax.device_put(kv, device))


def fresh(kv) -> list:
    """A copy of kv in new device buffers: numpy's view of a jax array is cached on it, so a second encode of the
    same arrays would skip the device-to-host copy a real transfer pays."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, kv))


def median_ms(run, repeats: int, setup=lambda: None) -> float:
    """The median time of run(setup()) (setup not timed), after one warm-up (compiles, first connections)."""
    run(setup())
    times = []
    for _ in range(repeats):
        x = setup()
        t = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


async def fetch_cost(kv, repeats: int, prefill=None, decode=None) -> tuple[float, float]:
    """(median ms a fetch, the event loop's longest stall in ms meanwhile: what a server's other requests wait).
    A fetch: the prefill side puts its pages (device arrays) in the store; the decode side fetches them."""
    store = KVStore()
    server = KVServer(store, HOST, 0, jax_endpoint=prefill)
    port = await server.start()
    ids = iter(range(repeats + 1))
    ticks = {"last": None, "stall": 0.0}  # last: the ticker's last wake-up while a fetch runs (None: none runs)

    async def ticker():
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            if ticks["last"] is not None:
                ticks["stall"] = max(ticks["stall"], now - ticks["last"] - 0.001)
                ticks["last"] = now

    async def one() -> float:
        tid, pages = f"r{next(ids)}", fresh(kv)  # the setup blocks the loop: not counted as a stall
        ticks["last"] = t = time.perf_counter()
        store.put(tid, pages)
        jax.block_until_ready(await fetch_pages(HOST, port, tid, timeout=120, jax_endpoint=decode))
        ticks["last"] = None
        return time.perf_counter() - t
    await one()  # warm-up
    ticks["stall"] = 0.0
    tick = asyncio.create_task(ticker())
    try:
        times = [await one() for _ in range(repeats)]
        return 1000 * statistics.median(times), 1000 * ticks["stall"]
    finally:
        tick.cancel()
        await server.close()


async def serve_in_child(prompt_len: int, kv_dtype: str, transfers: int) -> None:
    """The prefill side in its own process: transfers r0, r1, ... of fresh pages, each put once the last is taken."""
    kv = make_pages(prompt_len, kv_dtype, jax.devices()[0])
    store = KVStore(ttl_s=600)
    server = KVServer(store, HOST, 0, jax_endpoint=JaxTransferEndpoint(HOST))
    port = await server.start()
    store.put("r0", fresh(kv))
    print(port, flush=True)
    for i in range(1, transfers):
        while len(store):
            await asyncio.sleep(0.005)
        store.put(f"r{i}", await asyncio.to_thread(fresh, kv))
    while len(store):
        await asyncio.sleep(0.005)
    await asyncio.sleep(2)  # the last pull on the jax path completes after the reply
    await server.close()


def cross_process_costs(prompt_len: int, kv_dtype: str, repeats: int, decode) -> dict[str, tuple[float, None]]:
    """{path: (median ms, None)} of fetches from a child process (its own GIL and event loop, as a prefill server
    has): the bytes path, then the jax path, each after a warm-up fetch."""
    child = subprocess.Popen([sys.executable, __file__, "--serve-in-child", str(prompt_len), kv_dtype,
                              str(2 * (repeats + 1))], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())

        async def fetch_all() -> list[float]:
            times = []
            for i in range(2 * (repeats + 1)):
                while True:  # r{i} exists once the child has put it
                    t = time.perf_counter()
                    try:
                        kv = await fetch_pages(HOST, port, f"r{i}", timeout=120,
                                               jax_endpoint=decode if i > repeats else None)
                    except KVTransferError as e:
                        if "unknown" not in str(e):
                            raise
                        await asyncio.sleep(0.05)
                        continue
                    jax.block_until_ready(kv)
                    times.append(time.perf_counter() - t)
                    break
            return times
        times = asyncio.run(fetch_all())
        child.wait(timeout=60)
    finally:
        child.kill()
    return {"socket x-proc": (1000 * statistics.median(times[1:repeats + 1]), None),
            "jax x-proc": (1000 * statistics.median(times[repeats + 2:]), None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", default="1024,8192")
    parser.add_argument("--kv-dtypes", default="float32,int8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="scripts/bench_results/kv_transfer.json")
    parser.add_argument("--serve-in-child", nargs=3, metavar=("PROMPT_LEN", "KV_DTYPE", "TRANSFERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_in_child:
        prompt_len, kv_dtype, transfers = args.serve_in_child
        return asyncio.run(serve_in_child(int(prompt_len), kv_dtype, int(transfers)))
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit("needs two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    prefill, decode = JaxTransferEndpoint(HOST, devices[0]), JaxTransferEndpoint(HOST, devices[1])
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        for prompt_len in map(int, args.prompt_lens.split(",")):
            kv = make_pages(prompt_len, kv_dtype, devices[0])
            nbytes = sum(a.nbytes for a in jax.tree.leaves(kv))
            data = encode_pages(kv)
            costs = {  # path: (ms, the event loop's longest stall in ms)
                "device_put": (median_ms(lambda x: jax.block_until_ready(jax.device_put(x, devices[1])),
                                         args.repeats, lambda: kv), None),
                "socket": asyncio.run(fetch_cost(kv, args.repeats)),
                "socket encode": (median_ms(encode_pages, args.repeats, lambda: fresh(kv)), None),
                "socket decode": (median_ms(decode_pages, args.repeats, lambda data=data: data), None),
                "jax.transfer": asyncio.run(fetch_cost(kv, args.repeats, prefill, decode)),
                **cross_process_costs(prompt_len, kv_dtype, args.repeats, decode),
            }
            del data
            for path, (ms, stall) in costs.items():
                rows.append({"kv_dtype": kv_dtype, "prompt_len": prompt_len, "pages": kv[0][0].shape[0],
                             "path": path, "bytes": nbytes, "ms": round(ms, 2),
                             "GB_per_s": round(nbytes / ms / 1e6, 2),
                             "loop_stall_ms": None if stall is None else round(stall, 2)})
                print(rows[-1], flush=True)
    print(f"\n{'kv':8} {'prompt':>6} {'pages':>5} {'MB':>7}  {'path':14} {'ms':>8} {'GB/s':>6} {'loop stall ms':>13}")
    for r in rows:
        stall = "" if r["loop_stall_ms"] is None else f"{r['loop_stall_ms']:.1f}"
        print(f"{r['kv_dtype']:8} {r['prompt_len']:>6} {r['pages']:>5} {r['bytes'] / 1e6:>7.1f}  {r['path']:14} "
              f"{r['ms']:>8.1f} {r['GB_per_s']:>6.2f} {stall:>13}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "SmolLM2-135M", "page_size": PAGE_SIZE, "repeats": args.repeats,
                               "cpu_count": os.cpu_count(), "jax": jax.__version__, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
