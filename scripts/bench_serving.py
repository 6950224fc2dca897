"""Online serving benchmark: an HTTP load generator for any OpenAI-compatible server (jaxserve, vLLM, llama.cpp's
llama-server), streaming, with Poisson arrivals or a fixed concurrency, swept over several loads in one run.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000/v1 [--model NAME] [--endpoint completions|chat]
        [--num-requests 64] [--request-rates 0.5,1,2,inf | --request-rate R | --concurrency 1,4,8]
        [--prompt-len 128,16,512] [--output-len 64,8,256] [--seed 0] [--ttft-slo 1 --tpot-slo 0.1]
        [--tokenizer-model PATH] [--out bench_results/serving.json] [--plot]

Workload (scripts/workload.py synth_requests, the same seed gives the same lengths at every load): log-normal
prompt and output lengths (MEDIAN,MIN,MAX; one number = fixed length) and Poisson arrival times. The client has no
tokenizer, so a prompt is N words drawn from common English words that are one token each (with their leading
space) in GPT-2-style BPE vocabularies, so about N tokens (the server's usage.prompt_tokens is reported beside the
target); --tokenizer-model (a jaxserve model: GGUF, HF directory, checkpoint) trims the text to exactly N tokens of
that tokenizer. Words are drawn afresh for every load and every invocation (--prompt-seed, random by default and
recorded, and the load's index): no run hits a prefix cache (vLLM's, llama-server's cached slots) left by an earlier
one; the server's usage.prompt_tokens_details.cached_tokens, where it reports them, are summed per load. Every
request is greedy (temperature 0), asks for max_tokens = its sampled output length with ignore_eos (vLLM and
llama-server both accept it; --no-ignore-eos drops it), and streams with usage.

Loads: --request-rate(s) R sends each request at its Poisson arrival time (R requests/s; inf = all at once);
--concurrency C keeps C requests in flight (a new one is sent as one finishes). One row per load.

Per request, from the moment it is sent: TTFT = first chunk carrying text; ITL = gaps between chunks carrying text
(a server may put several tokens in one chunk, so ITL is per chunk); E2E = until the stream ends; output tokens =
the final usage chunk's completion_tokens (else the number of text chunks); TPOT = (E2E - TTFT) / (output tokens
- 1). Run figures are over the run's wall time (first send to last finish): requests/s, output tok/s, goodput =
requests/s finishing with TTFT <= --ttft-slo and TPOT <= --tpot-slo (whichever are given). Percentiles P50/P95/P99.
Writes JSON (--out) and, with --plot and matplotlib, a PNG beside it: TTFT and TPOT p50/p99 against the load.

--server-metrics (a jaxserve server): where a request's TTFT goes, from the server's Prometheus histograms read
before and after each load (their sums over their counts): `server_mean_s` has the mean queue time (arrival in the
engine, after tokenizing, to first planned into a step) and TTFT inside the server (arrival to first token read
back); the client's TTFT less the server's is HTTP, tokenizing and streaming the token out.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from workload import describe, percentiles, synth_requests  # noqa: E402

# Lowercase words that are one token each, with their leading space, in the GPT-2-style BPE vocabularies of
# Llama 3, Qwen 2, SmolLM2 and GPT-2 itself (checked against SmolLM2's tokenizer): a prompt of N of them is ~N tokens.
WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there one all we their has been would when more will if no out so said what up its about
into than them can only other new some time could these two may then do first any my now such like our over man
me even most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come since against go came
right used take three states himself few house use during without again place around however home small found
thought went say part once general high upon school every does got united left number course war until always
away something fact though water less public put think almost hand enough far took head yet government system
better set told nothing night end why called didn find going look asked later point knew city next program give
group toward young days let room president side social given present several order national possible rather second
face per among form important often things looked early white case john become large big need four within felt
along children saw best church ever least power development light thing seemed family interest want members mind
country area others done turned although open god service problem certain kind different thus began door help means
sense whole matter perhaps itself times law human line above name example action company hands local show
five history whether gave either today act feet across taken past quite anything seen having death week experience
word field car words money body""".split()


@dataclasses.dataclass
class Result:
    ok: bool = False
    status: int | None = None
    error: str | None = None
    sent: float = 0.0  # seconds after the run's start
    ttft: float | None = None
    e2e: float | None = None
    itl: list = dataclasses.field(default_factory=list)
    text_chunks: int = 0
    output_tokens: int = 0
    usage_tokens: bool = False  # output_tokens came from the server's usage (else: text chunks counted)
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    cached_tokens: int = 0  # the server's usage.prompt_tokens_details.cached_tokens
    max_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""  # the streamed text, joined

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.ok and self.output_tokens > 1 else None


def parse_lengths(s: str) -> tuple[int, int, int]:
    """'MEDIAN,MIN,MAX' or 'N' (fixed length)."""
    v = [int(x) for x in s.split(",")]
    if len(v) == 1:
        v = v * 3
    if len(v) != 3 or not 1 <= v[1] <= v[0] <= v[2]:
        raise argparse.ArgumentTypeError(f"want MEDIAN,MIN,MAX with 1 <= MIN <= MEDIAN <= MAX or one N, got {s!r}")
    return tuple(v)


def parse_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def load_tokenizer(model: str):
    """A jaxserve model's tokenizer; a GGUF's is read from its metadata alone, without loading the weights."""
    from jaxserve.weights import resolve_model_path
    path = resolve_model_path(model)
    if path.is_file():
        from jaxserve.tokenizer import Tokenizer
        from jaxserve.weights.gguf import open_gguf
        return Tokenizer.from_gguf_fields(open_gguf(path))
    from jaxserve.weights import load_model, resolve_dtype
    tok = load_model(model, resolve_dtype("float32")).tokenizer
    if tok is None:
        raise SystemExit(f"{model} has no tokenizer")
    return tok


def make_prompt(rng, n: int, tokenizer=None) -> str:
    """About n tokens of text (exactly n of `tokenizer`'s, special tokens not counted, when given)."""
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n + 8)]
    if tokenizer is None:
        return " ".join(words[:n])
    text = " ".join(words)
    while len(ids := tokenizer.encode(text, add_special_tokens=False)) < n:  # words of several tokens never
        text += " " + " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))  # shorten it; runs at most once
    text = tokenizer.decode(ids[:n])
    for _ in range(4):  # decode(encode) can merge across the cut; trim or pad by the difference
        got = len(ids := tokenizer.encode(text, add_special_tokens=False))
        if got == n:
            break
        text = tokenizer.decode(ids[:n]) if got > n else text + " " + " ".join(WORDS[:n - got])
    return text


def request_body(args, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body)
    return body


async def send(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> Result:
    """One streamed request; all times in seconds, `sent` relative to t0 and the rest relative to the send."""
    r = Result(max_tokens=body["max_tokens"])
    start = time.perf_counter()
    r.sent = start - t0
    last = None
    done = False
    try:
        async with session.post(url, json=body) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:  # SSE: "data: {json}" lines, blank lines between events
                line = raw.strip()
                if not line or line.startswith(b":"):
                    continue
                if line.startswith(b"error:"):
                    r.error = line.decode(errors="replace")[:300]
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    r.error = json.dumps(chunk["error"])[:300]
                    break
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text")
                    if piece is None:
                        delta = choice.get("delta") or {}
                        piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece:
                        if last is None:
                            r.ttft = now - start
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.text_chunks += 1
                        r.text += piece
                    r.finish_reason = choice.get("finish_reason") or r.finish_reason
                if chunk.get("usage"):
                    r.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    r.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    r.cached_tokens = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    r.usage_tokens = True
            end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"[:300]
        return r
    if r.error is None and not done and r.finish_reason is None:
        r.error = "stream ended without [DONE] or a finish_reason"
    if r.error is None and r.ttft is None:
        r.error = "no text in the stream"
    if r.error is None:
        r.ok = True
        r.e2e = end - start
        if not r.usage_tokens:
            r.output_tokens = r.text_chunks
    return r


async def run_load(session, url, bodies, arrivals, concurrency: int | None) -> tuple[list[Result], float]:
    """Sends bodies at their arrival times (seconds after the start), or `concurrency` at a time in order."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(body, at):
        if sem is not None:
            async with sem:
                return await send(session, url, body, t0)
        if (delay := t0 + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        return await send(session, url, body, t0)

    results = await asyncio.gather(*(one(b, a) for b, a in zip(bodies, arrivals)))
    return results, time.perf_counter() - t0


def summarize(load: dict, results: list[Result], seconds: float, ttft_slo, tpot_slo, prompt_targets) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    row = {**load, "seconds": round(seconds, 2), "completed": len(ok), "failed": len(results) - len(ok),
           "requests_per_s": round(len(ok) / seconds, 3), "output_tok_s": round(out_tokens / seconds, 1),
           "total_tok_s": round((out_tokens + sum(prompt_tokens)) / seconds, 1) if prompt_tokens else None,
           "output_tokens": out_tokens,
           "short_outputs": sum(r.output_tokens < r.max_tokens for r in ok),  # stopped before max_tokens
           "tokens_from_usage": sum(r.usage_tokens for r in ok),
           "tokens_per_text_chunk": round(out_tokens / max(1, sum(r.text_chunks for r in ok)), 3),
           "prompt_tokens_target": sum(n for n, r in zip(prompt_targets, results) if r.ok),
           "prompt_tokens_server": sum(prompt_tokens) if prompt_tokens else None,
           "prompt_tokens_cached": sum(r.cached_tokens for r in ok),
           "send_span_s": round(max(r.sent for r in results) - min(r.sent for r in results), 2),
           "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpot),
           "itl_s": percentiles([x for r in ok for x in r.itl]), "e2e_s": percentiles([r.e2e for r in ok]),
           "mean_s": {k: round(float(np.mean(v)), 4) if v else None for k, v in
                      (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("e2e", [r.e2e for r in ok]))}}
    if ttft_slo is not None or tpot_slo is not None:
        good = sum((ttft_slo is None or r.ttft <= ttft_slo) and (tpot_slo is None or r.tpot is None
                                                                  or r.tpot <= tpot_slo) for r in ok)
        row["goodput"] = {"requests_per_s": round(good / seconds, 3), "fraction": round(good / len(results), 3),
                          "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo}
    errors = sorted({r.error for r in results if r.error})
    if errors:
        row["errors"] = errors[:5]
    return row


def finite_json(x):
    """inf (an all-at-once rate) as the string "inf": strict JSON has no Infinity."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def load_label(row) -> str:
    return f"c={row['concurrency']}" if "concurrency" in row else f"{row['request_rate']:g}/s"


def table(rows, slo: bool) -> None:
    def p(d, k, scale=1e3):
        return f"{d[k] * scale:.0f}" if k in d else "-"

    print(f"{'load':>8}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>10}" + (f"{'goodput':>9}" if slo else "")
          + f"{'TTFT p50/p95/p99 ms':>22}{'TPOT p50/p95/p99 ms':>22}{'ITL p50/p99 ms':>16}{'E2E p50/p99 s':>16}")
    for r in rows:
        t, o, i, e = r["ttft_s"], r["tpot_s"], r["itl_s"], r["e2e_s"]
        good = f"{r['goodput']['requests_per_s']:>9.2f}" if slo else ""
        e2e = f"{e['p50']:.2f}/{e['p99']:.2f}" if e else "-"
        print(f"{load_label(r):>8}{r['completed']:>5}{r['failed']:>5}{r['requests_per_s']:>8.2f}"
              f"{r['output_tok_s']:>10.1f}{good}{'/'.join(p(t, k) for k in ('p50', 'p95', 'p99')):>22}"
              f"{'/'.join(p(o, k) for k in ('p50', 'p95', 'p99')):>22}"
              f"{'/'.join(p(i, k) for k in ('p50', 'p99')):>16}{e2e:>16}")
        if r["prompt_tokens_cached"] > 0.05 * (r["prompt_tokens_server"] or 1):
            print(f"{'':>8}note: the server reused {r['prompt_tokens_cached']} cached prompt tokens "
                  f"of {r['prompt_tokens_server']}")
        server = r.get("server_mean_s")
        if server and server["ttft"] is not None:
            print(f"{'':>8}server means: queue {server['queue'] * 1e3:.0f} ms, TTFT in the server "
                  f"{server['ttft'] * 1e3:.0f} ms, client TTFT {r['mean_s']['ttft'] * 1e3:.0f} ms")
        for err in r.get("errors", []):
            print(f"{'':>8}error: {err}")


def plot(rows, path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conc = "concurrency" in rows[0]
    xs = [r["concurrency"] if conc else r["request_rate"] for r in rows]
    finite = [x for x in xs if math.isfinite(x)]
    inf_at = 2 * max(finite) if finite else 1.0  # "all at once" drawn right of the highest finite rate
    pos = [x if math.isfinite(x) else inf_at for x in xs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            pts = [(x, r[key][q] * 1e3) for x, r in zip(pos, rows) if q in r[key]]
            ax.plot([a for a, _ in pts], [b for _, b in pts], style, label=f"{name} {q}")
        ax.set_ylabel("ms")
        ax.set_title(name)
    axes[2].plot(pos, [r["output_tok_s"] for r in rows], "o-", label="output tok/s")
    axes[2].set_title("output tokens / s")
    if "goodput" in rows[0]:
        ax2 = axes[2].twinx()
        ax2.plot(pos, [r["goodput"]["requests_per_s"] for r in rows], "s--", color="C3", label="goodput req/s")
        ax2.plot(pos, [r["requests_per_s"] for r in rows], "^:", color="C2", label="req/s")
        ax2.set_ylabel("requests / s")
        ax2.legend(loc="lower right", fontsize=8)
    for ax in axes:
        ax.set_xlabel("concurrency" if conc else "request rate (req/s)")
        ax.set_xticks(pos, [f"{x:g}" if math.isfinite(x) else "inf" for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# The server's histograms whose means split a request's TTFT (--server-metrics): name in the row -> metric.
SERVER_HISTOGRAMS = {"queue": "jaxserve:request_queue_time_seconds", "ttft": "jaxserve:time_to_first_token_seconds"}


async def histogram_totals(session, metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of SERVER_HISTOGRAMS, over every label set, from a Prometheus text page."""
    async with session.get(metrics_url) as resp:
        resp.raise_for_status()
        text = await resp.text()
    totals = {}
    for key, name in SERVER_HISTOGRAMS.items():
        def total(suffix):
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "))
        totals[key] = (total("_sum"), total("_count"))
    return totals


def histogram_means(before: dict, after: dict) -> dict:
    means = {}
    for key in SERVER_HISTOGRAMS:
        n = after[key][1] - before[key][1]
        means[key] = round((after[key][0] - before[key][0]) / n, 4) if n else None
    return means


async def get_json(session, url):
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def amain(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    url = f"{base}/chat/completions" if args.endpoint == "chat" else f"{base}/completions"
    tokenizer = load_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
    if args.concurrency:
        loads = [{"concurrency": int(c)} for c in args.concurrency]
    else:
        loads = [{"request_rate": r} for r in (args.request_rates or [args.request_rate])]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=not args.keep_alive)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        models = None
        model = args.model
        if model is None:
            models = await get_json(session, f"{base}/models")
            model = models["data"][0]["id"]
        print(f"{url}  model {model}")
        warm_rng = np.random.default_rng([args.prompt_seed, 1 << 20])
        for _ in range(args.warmup):  # checks the endpoint, and takes any first-request costs out of the runs
            r = await send(session, url, request_body(args, model, make_prompt(warm_rng, 16, tokenizer), 8),
                           time.perf_counter())
            if not r.ok:
                raise SystemExit(f"warm-up request failed: {r.error}")
        rows = []
        for i, load in enumerate(loads):
            reqs = synth_requests(args.num_requests, args.seed, prompt=args.prompt_len, output=args.output_len,
                                  request_rate=load.get("request_rate", float("inf")))
            rng = np.random.default_rng([args.prompt_seed, i])  # fresh words per load: no prefix-cache reuse
            targets = [len(q.prompt_token_ids) for q in reqs]
            bodies = [request_body(args, model, make_prompt(rng, n, tokenizer), q.max_tokens)
                      for n, q in zip(targets, reqs)]
            metrics_url = base.removesuffix("/v1") + "/metrics"
            before = await histogram_totals(session, metrics_url) if args.server_metrics else None
            results, seconds = await run_load(session, url, bodies, [q.arrival for q in reqs], load.get("concurrency"))
            rows.append(summarize(load, results, seconds, args.ttft_slo, args.tpot_slo, targets))
            if before is not None:
                rows[-1]["server_mean_s"] = histogram_means(before, await histogram_totals(session, metrics_url))
            rows[-1]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # other load on a shared host shows here
            print(f"  {load_label(rows[-1])}: {rows[-1]['completed']}/{len(results)} ok in {seconds:.1f} s", flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "client": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "server": {"base_url": base, "endpoint": url, "model": model, "models": models},
            "args": vars(args),
            "workload": describe(synth_requests(args.num_requests, args.seed, prompt=args.prompt_len,
                                                output=args.output_len)),
            "prompt_words": "tokenizer-exact" if tokenizer else "one word ~ one token", "runs": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first of GET /models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--num-requests", type=int, default=64)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (inf: at once)")
    load.add_argument("--request-rates", type=parse_floats, help="sweep: comma list of rates, e.g. 0.5,1,2,inf")
    load.add_argument("--concurrency", type=parse_floats, help="requests in flight (comma list to sweep)")
    ap.add_argument("--prompt-len", type=parse_lengths, default=(128, 16, 512), help="MEDIAN,MIN,MAX or N tokens")
    ap.add_argument("--output-len", type=parse_lengths, default=(64, 8, 256), help="MEDIAN,MIN,MAX or N tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-seed", type=int, default=None,
                    help="seeds the prompts' words (default: random, so a rerun misses the server's prefix cache)")
    ap.add_argument("--tokenizer-model", default=None, help="jaxserve model whose tokenizer sizes prompts exactly")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    ap.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds")
    ap.add_argument("--warmup", type=int, default=1, help="short unmeasured requests first")
    ap.add_argument("--keep-alive", action="store_true",
                    help="reuse connections (default: one per request; llama-server closes idle kept-alive ones, "
                         "and a request written into a closing connection fails)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    ap.add_argument("--server-metrics", action="store_true",
                    help="a jaxserve server: split TTFT with its /metrics (queue time, TTFT in the server)")
    ap.add_argument("--out", default="bench_results/serving.json")
    ap.add_argument("--plot", action="store_true", help="PNG beside --out (needs matplotlib)")
    args = ap.parse_args()
    if args.concurrency and any(c < 1 or c != int(c) for c in args.concurrency):
        ap.error("--concurrency wants positive integers")
    if args.prompt_seed is None:
        args.prompt_seed = int.from_bytes(os.urandom(4), "little")
    results = asyncio.run(amain(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite_json(results), indent=1))
    print(json.dumps(results["workload"]))
    table(results["runs"], "goodput" in results["runs"][0])
    wrote = [str(out)]
    if args.plot and plot(results["runs"], out.with_suffix(".png"),
                          f"{results['server']['model']} at {args.base_url} ({args.endpoint}), "
                          f"{args.num_requests} requests per load"):
        wrote.append(str(out.with_suffix(".png")))
    print("wrote " + " and ".join(wrote))


if __name__ == "__main__":
    main()
