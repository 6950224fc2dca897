"""Prefill/decode disaggregation against colocation, measured: an open-loop load of long prompts and streamed decodes
against OpenAI-compatible servers, the servers launched (and pinned) here.

    # the issue's measurement (a quiet machine, ~65 min): colocated on both cores, then prefill on core 0 + decode on
    # core 1 + the router, each at every rate
    python scripts/bench_pd.py --rates 0.03,0.06,0.12 --num-requests 32 --ttft-slo 20 --tpot-slo 0.3 \
        --out scripts/bench_results/pd.json
    # a minute's check of the script itself against one colocated server
    python scripts/bench_pd.py --smoke
    # servers already running (nothing launched): a name and a base URL each
    python scripts/bench_pd.py --url colocated=http://127.0.0.1:8000/v1 --url disaggregated=http://127.0.0.1:8100/v1
    # another tree's code as the baseline, in the same run (issue 53: the decode server's TPOT before and after):
    # its servers and this tree's, interleaved, --repeats times each, and the medians side by side
    python scripts/bench_pd.py --setups disaggregated --rates 0.08,0.16 --num-requests 12 --ttft-slo 10 \
        --tpot-slo 0.2 --baseline-pythonpath /path/to/main --repeats 2 --out scripts/bench_results/pd_imports.json

Setups (--setups; each one's servers started, health-checked, warmed and stopped in turn; commands are templates,
flags to adjust, logs beside --out):
  - colocated: `taskset -c 0,1 jaxserve serve` (--colocated-cmd);
  - disaggregated: `taskset -c 0 jaxserve serve --role prefill`, `taskset -c 1 jaxserve serve --role decode`
    and `jaxserve router --prefill URL --decode URL` (--prefill-cmd, --decode-cmd, --router-cmd).
  Placeholders: {python}, {port}, {serve_args} (--serve-args, the same for every server), {prefill_url},
  {decode_url}. The role servers and the router share a KV transfer secret (JAXSERVE_KV_SECRET: a random one unless
  set). With --baseline-pythonpath DIR each setup also runs as SETUP@baseline with PYTHONPATH=DIR (another checkout's
  code: main's, say), the two alternating --repeats times on the same workload; the summary gives the medians of
  each one's TPOT and inter-token latency percentiles and their ratios.

Workload (scripts/workload.py with the same seed at every rate and setup, so each sees the same lengths and arrival
times): Poisson arrivals at each --rates, prompts log-normal in --prompt-len (default median 1400, 1024-2048 tokens,
exactly that many of the model's tokenizer: words of common English drawn afresh per run so no prefix cache helps),
outputs in --output-len (default 128, 64-256) asked as max_tokens with ignore_eos, so lengths are what was asked;
greedy; streamed. The per-request measurement is bench_serving's: TTFT = the first text chunk; TPOT = (end - TTFT) /
(output tokens - 1). Per run: P50/P95/P99 of each, requests/s and output tokens/s over the run (first send to last
token), goodput = requests/s meeting TTFT <= --ttft-slo and TPOT <= --tpot-slo (stated in the table and the JSON).
The JSON keeps every request (send time, prompt tokens as the server counted them, TTFT, TPOT): simulate_pd.py
--compare replays exactly those.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import (  # noqa: E402
    finite_json,
    load_tokenizer,
    make_prompt,
    parse_floats,
    parse_lengths,
    request_body,
    run_load,
    send,
    summarize,
)
from workload import describe, synth_requests  # noqa: E402

SECRET_ENV = "JAXSERVE_KV_SECRET"  # (jaxserve.openai.kv_transfer_params.SECRET_ENV: this script imports no jaxserve)
SERVE = "{python} -m jaxserve.cli serve --port {port} {serve_args}"
DEFAULT_CMDS = {
    "colocated": "taskset -c 0,1 " + SERVE,
    "prefill": "taskset -c 0 " + SERVE + " --role prefill",
    "decode": "taskset -c 1 " + SERVE + " --role decode",
    "router": "{python} -m jaxserve.cli router --port {port} --prefill {prefill_url} --decode {decode_url}",
}
# The longest prompt and output of the default workload, and the chat-free completions endpoint.
SERVE_ARGS = "--max-model-len 2560"


@dataclasses.dataclass
class Server:
    name: str
    command: str
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    env: dict = dataclasses.field(default_factory=dict)  # over os.environ (PYTHONPATH for a baseline's code)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"  starting {self.name}: {self.command}  (log {self.log})", flush=True)
        # A session of its own, so stopping it stops what taskset started too.
        self.proc = subprocess.Popen(shlex.split(self.command), stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; its log: {self.log}\n"
                                 + self.log.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not healthy after {timeout:.0f} s; its log: {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def servers_for(setup: str, args, logs: Path) -> list[Server]:
    """The servers of a setup, in start order; the last one is what clients talk to."""
    fill = dict(python=shlex.quote(sys.executable), serve_args=args.serve_args)
    port = args.base_port
    if setup == "colocated":
        return [Server("colocated", args.colocated_cmd.format(port=port, **fill), port, logs / "colocated.log")]
    prefill = Server("prefill", args.prefill_cmd.format(port=port + 1, **fill), port + 1, logs / "prefill.log")
    decode = Server("decode", args.decode_cmd.format(port=port + 2, **fill), port + 2, logs / "decode.log")
    router = Server("router", args.router_cmd.format(port=port, prefill_url=prefill.url, decode_url=decode.url,
                                                     **fill), port, logs / "router.log")
    return [prefill, decode, router]


def variants(args) -> list[tuple[str, dict]]:
    """(label suffix, environment) of each code under test: this tree's, and a baseline's before it if asked."""
    ours = ("", {})
    return [("@baseline", {"PYTHONPATH": args.baseline_pythonpath}), ours] if args.baseline_pythonpath else [ours]


def compare(rows: list[dict]) -> list[dict]:
    """Per setup label and rate: the medians over repeats of TPOT and ITL P50/P95 (ms) and P95/P50; beside a
    baseline, each one's ratio to it."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        if r["tpot_s"] and r["itl_s"]:
            groups.setdefault((r["setup"], r["request_rate"]), []).append(r)
    out = []
    for (label, rate), rs in groups.items():
        med = {f"{m}_{k}_ms": round(float(np.median([r[f"{m}_s"][k] for r in rs]) * 1e3), 1)
               for m in ("tpot", "itl") for k in ("p50", "p95", "p99")}
        out.append({"setup": label, "request_rate": rate, "repeats": len(rs), **med,
                    "tpot_p95_over_p50": round(med["tpot_p95_ms"] / med["tpot_p50_ms"], 2),
                    "itl_p95_over_p50": round(med["itl_p95_ms"] / med["itl_p50_ms"], 2)})
    base = {(o["setup"].removesuffix("@baseline"), o["request_rate"]): o
            for o in out if o["setup"].endswith("@baseline")}
    for o in out:
        b = base.get((o["setup"], o["request_rate"]))
        if b is not None:
            o["vs_baseline"] = {k: round(o[k] / b[k], 2) for k in ("tpot_p50_ms", "tpot_p95_ms", "itl_p50_ms",
                                                                   "itl_p95_ms", "itl_p99_ms")}
    print(f"\nmedians over repeats{'':<8}{'TPOT p50/p95 ms':>18}{'p95/p50':>8}{'ITL p50/p95/p99 ms':>20}"
          f"{'p95/p50':>8}  against the baseline (TPOT p50, p95; ITL p50, p95, p99)")
    for o in sorted(out, key=lambda o: (o["request_rate"], o["setup"])):
        v = o.get("vs_baseline")
        against = "" if v is None else ("  " + ", ".join(f"{v[k]:.2f}x" for k in ("tpot_p50_ms", "tpot_p95_ms"))
                                        + "; " + ", ".join(f"{v[f'itl_{p}_ms']:.2f}x" for p in ("p50", "p95", "p99")))
        itl = "/".join(f"{o[f'itl_{p}_ms']:.0f}" for p in ("p50", "p95", "p99"))
        print(f"{o['setup']:<22}{o['request_rate']:>6g}{o['tpot_p50_ms']:>9.0f}/{o['tpot_p95_ms']:<8.0f}"
              f"{o['tpot_p95_over_p50']:>8.2f}{itl:>20}{o['itl_p95_over_p50']:>8.2f}{against}")
    return out


def request_record(r, prompt_target: int) -> dict:
    """What simulate_pd.py replays and what the percentiles are computed from."""
    return {"sent": round(r.sent, 4), "ok": r.ok, "prompt_target": prompt_target, "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens, "output_tokens": r.output_tokens,
            "ttft": None if r.ttft is None else round(r.ttft, 4), "tpot": None if r.tpot is None else round(r.tpot, 5),
            "e2e": None if r.e2e is None else round(r.e2e, 4), "error": r.error}


async def measure(base_url: str, setup: str, args, tokenizer, run_index: int) -> list[dict]:
    """Every rate against one server (base_url ends in /v1); one row per rate."""
    url = f"{base_url}/completions"
    opts = argparse.Namespace(endpoint="completions", ignore_eos=True, extra_body={})
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    rows = []
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        try:
            async with s.get(f"{base_url}/models") as resp:
                resp.raise_for_status()
                model = (await resp.json(content_type=None))["data"][0]["id"]
        except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
            raise SystemExit(f"{setup}: no model from {base_url}/models: {type(e).__name__}: {e}")
        warm_rng = np.random.default_rng([args.prompt_seed, run_index, 1 << 20])
        for n in args.warmup_prompts:  # first-request costs (and a chunked prompt's path) out of the runs
            r = await send(s, url, request_body(opts, model, make_prompt(warm_rng, n, tokenizer), 4),
                           time.perf_counter())
            if not r.ok:
                raise SystemExit(f"{setup}: warm-up request failed: {r.error}")
        for i, rate in enumerate(args.rates):
            reqs = synth_requests(args.num_requests, args.seed, prompt=args.prompt_len, output=args.output_len,
                                  request_rate=rate)
            rng = np.random.default_rng([args.prompt_seed, run_index, i])  # fresh words: no prefix-cache reuse
            targets = [len(q.prompt_token_ids) for q in reqs]
            bodies = [request_body(opts, model, make_prompt(rng, n, tokenizer), q.max_tokens)
                      for n, q in zip(targets, reqs)]
            results, seconds = await run_load(s, url, bodies, [q.arrival for q in reqs], None)
            row = {"setup": setup, **summarize({"request_rate": rate}, results, seconds, args.ttft_slo,
                                               args.tpot_slo, targets)}
            row["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
            row["requests"] = [request_record(r, n) for r, n in zip(results, targets)]
            rows.append(row)
            print(f"  {setup} at {rate:g} req/s: {row['completed']}/{len(results)} ok in {seconds:.1f} s, goodput "
                  f"{row['goodput']['requests_per_s']:.3f} req/s", flush=True)
    return rows


def table(rows: list[dict], ttft_slo: float, tpot_slo: float) -> None:
    print(f"\ngoodput: requests/s with TTFT <= {ttft_slo:g} s and TPOT <= {tpot_slo * 1e3:g} ms "
          f"(met: the fraction of requests)")
    print(f"{'setup':<15}{'rate':>6}{'ok':>5}{'fail':>5}{'req/s':>7}{'out tok/s':>10}{'goodput':>9}{'met':>6}"
          f"{'TTFT p50/p95/p99 s':>22}{'TPOT p50/p95/p99 ms':>22}")
    for r in rows:
        t, o = r["ttft_s"], r["tpot_s"]
        ttft = "/".join(f"{t[k]:.2f}" for k in ("p50", "p95", "p99")) if t else "-"
        tpot = "/".join(f"{o[k] * 1e3:.0f}" for k in ("p50", "p95", "p99")) if o else "-"
        print(f"{r['setup']:<15}{r['request_rate']:>6g}{r['completed']:>5}{r['failed']:>5}{r['requests_per_s']:>7.3f}"
              f"{r['output_tok_s']:>10.1f}{r['goodput']['requests_per_s']:>9.3f}{r['goodput']['fraction']:>6.0%}"
              f"{ttft:>22}{tpot:>22}")
        for err in r.get("errors", []):
            print(f"{'':>15}error: {err}")


SMOKE = dict(rates=[1.0], num_requests=6, prompt_len=(96, 64, 160), output_len=(16, 8, 32), setups=["colocated"],
             serve_args="--max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 128", warmup_prompts=[8])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", type=lambda s: s.split(","), default=["colocated", "disaggregated"])
    ap.add_argument("--url", action="append", default=[], metavar="SETUP=BASE_URL",
                    help="measure a running server (its /v1 base URL) instead of launching; repeatable")
    ap.add_argument("--rates", type=parse_floats, default=[0.03, 0.06, 0.12], help="Poisson arrivals per second")
    ap.add_argument("--num-requests", type=int, default=32, help="per rate")
    ap.add_argument("--prompt-len", type=parse_lengths, default=(1400, 1024, 2048), help="MEDIAN,MIN,MAX tokens")
    ap.add_argument("--output-len", type=parse_lengths, default=(128, 64, 256), help="MEDIAN,MIN,MAX tokens")
    ap.add_argument("--seed", type=int, default=0, help="lengths and arrival times")
    ap.add_argument("--prompt-seed", type=int, default=None, help="the prompts' words (default: random, recorded)")
    ap.add_argument("--tokenizer-model", default="", help="sizes prompts exactly ('' = the default model's; "
                    "'none' = one common word ~ one token)")
    ap.add_argument("--ttft-slo", type=float, default=20.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.3, help="seconds")
    ap.add_argument("--warmup-prompts", type=lambda s: [int(x) for x in s.split(",")], default=[16, 1200],
                    help="prompt tokens of the unmeasured requests each server gets first")
    ap.add_argument("--serve-args", default=SERVE_ARGS, help="flags every jaxserve serve gets ({serve_args})")
    ap.add_argument("--colocated-cmd", default=DEFAULT_CMDS["colocated"])
    ap.add_argument("--prefill-cmd", default=DEFAULT_CMDS["prefill"])
    ap.add_argument("--decode-cmd", default=DEFAULT_CMDS["decode"])
    ap.add_argument("--router-cmd", default=DEFAULT_CMDS["router"])
    ap.add_argument("--base-port", type=int, default=8470, help="client-facing port; prefill +1, decode +2")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds for a server to compile and listen")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    ap.add_argument("--baseline-pythonpath", default=None, metavar="DIR",
                    help="also run each setup on the code under DIR (PYTHONPATH=DIR), alternating with this tree's")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each setup (and its baseline), alternating")
    ap.add_argument("--smoke", action="store_true", help="6 short requests at 1 req/s against one small colocated "
                    "server: checks this script in about a minute (figures meaningless; other flags still apply)")
    ap.add_argument("--out", default=None, help="default: bench_results/pd.json (--smoke: pd_smoke.json)")
    args = ap.parse_args(argv)
    if args.smoke:  # its values as defaults: flags given beside --smoke still count
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    args.out = args.out or ("bench_results/pd_smoke.json" if args.smoke else "bench_results/pd.json")
    if args.prompt_seed is None:
        args.prompt_seed = int.from_bytes(os.urandom(4), "little")
    urls = dict(u.split("=", 1) for u in args.url)
    print(f"setups {', '.join(urls or args.setups)}; rates {args.rates} req/s, {args.num_requests} requests each; "
          f"prompts {args.prompt_len}, outputs {args.output_len} tokens (median, min, max); SLOs TTFT <= "
          f"{args.ttft_slo:g} s, TPOT <= {args.tpot_slo * 1e3:g} ms", flush=True)
    tokenizer = None if args.tokenizer_model == "none" else load_tokenizer(args.tokenizer_model or None)
    out = Path(args.out)
    # Role servers serve kv_transfer_params only under a secret shared with the router (issue 48)
    os.environ.setdefault(SECRET_ENV, os.urandom(16).hex())
    rows, setups = [], list(urls) if urls else args.setups
    for repeat in range(args.repeats):
        for i, setup in enumerate(setups):
            for suffix, env in ([("", {})] if setup in urls else variants(args)):
                label = setup + suffix
                logs = out.parent / f"{out.stem}_logs" / (label if args.repeats == 1 else f"{label}_{repeat}")
                servers = [] if setup in urls else servers_for(setup, args, logs)
                for server in servers:
                    server.env = env
                try:
                    for server in servers:
                        server.start()
                        server.wait_healthy(args.start_timeout)
                    base = urls[setup] if setup in urls else f"{servers[-1].url}/v1"
                    rows += asyncio.run(measure(base.rstrip("/"), label, args, tokenizer, i))  # (i: same prompts)
                finally:
                    for server in reversed(servers):
                        server.stop()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
              "machine": {"cores": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
              "commands": {s.name: s.command for setup in setups if setup not in urls
                           for s in servers_for(setup, args, out.parent)},
              "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
              "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
              "workload": describe(synth_requests(args.num_requests, args.seed, prompt=args.prompt_len,
                                                  output=args.output_len)),
              "prompts": "tokenizer-exact" if tokenizer else "one word ~ one token", "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite_json(result), indent=1))
    print(json.dumps(result["workload"]))
    table(rows, args.ttft_slo, args.tpot_slo)
    if args.baseline_pythonpath or args.repeats > 1:
        result["compared"] = compare(rows)
        out.write_text(json.dumps(finite_json(result), indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
