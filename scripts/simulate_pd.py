"""Prefill/decode disaggregation against colocation, simulated: TTFT, TPOT and goodput from step costs.

A discrete-event simulation of jaxserve's engines under Poisson arrivals (the trace scripts/bench_pd.py sends: the
same seed gives the same lengths and arrival times):
  - colocated: N replicas (least-loaded routing), each planning its steps as `jaxserve.batching.scheduler` does
    (fcfs): every decoding sequence one token first, then prompt chunks in the token budget left (running
    sequences' first, then waiting ones admitted while a slot and pages for their whole prompt are free); a decode
    short of a page preempts the newest running sequence (recomputed later from its tokens); chunks cut to the
    bucket below when padding would exceed a quarter (`Scheduler._fit_to_bucket`);
  - disaggregated: P prefill replicas (chunks only; a sequence leaves once its first token is out, its pages freed)
    and D decode replicas (a hand-off is admitted when a slot and its pages are free, then decodes), the KV moved
    between them in `kv_fixed_s + bytes / kv_bytes_per_s` per request (plus each side's own gather / scatter at
    `kv_copy_bytes_per_s`, time its engine spends on it), and `hop_s` added to every token a router relays.
A step takes `costs.seconds(decode contexts, prompt chunks)`: on this machine `StepCosts`, measured
(scripts/measure_step_costs.py: a time per token bucket plus the cached keys the XLA:CPU attention reads, see
`attention_work`); for projections `RooflineCosts`, an accelerator's roofline (the larger of FLOPs / peak and
bytes / bandwidth, each at a stated efficiency) for an 8B model. Not modelled: prefix-cache hits (the trace's prompts
are fresh), the host's share of a step (hidden by the engine's lookahead), contention between concurrent transfers.

    # this machine: colocated on 2 cores against 1 prefill core + 1 decode core, at the rates bench_pd runs
    python scripts/simulate_pd.py --rates 0.03,0.06,0.12 [--compare scripts/bench_results/pd.json]
    # projection only: 8B on v5e / H100, per-device goodput for P:D splits (P + D <= 8), the plot
    python scripts/simulate_pd.py --rates "" --project --plot docs/pd_goodput.png

Per request: TTFT = first token - arrival; TPOT = (last token - first token) / (output tokens - 1). Per run:
P50/P95/P99, throughput, goodput = requests/s meeting TTFT <= --ttft-slo and TPOT <= --tpot-slo over the run (first
arrival to last token, as bench_pd counts it), attainment = the fraction meeting both. Projection: a setup's
per-device goodput (DistServe's) is the highest arrival rate per device at which >= --attainment of requests meet
both SLOs (found by bisection).
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from workload import percentiles, synth_requests  # noqa: E402

HERE = Path(__file__).parent
# Mirrored from jaxserve (not imported: the simulator runs without jax): the scheduler's COMPUTE_BOUND_TOKENS and
# ragged_attention's small_step (both 64), long_row_share and key blocks.
SMALL_STEP = 64  # jaxserve.model.attention.ragged_attention: at most this many tokens take one group, no long-row pass
LONG_ROW_SHARE = 8
BLOCK_KEYS = 128  # block_pages (8) x page_size (16): attention walks cached keys in blocks of this many


def round_up(n: int, buckets) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def attention_work(decode: list[int], chunks: list[tuple[int, int]], token_buckets, max_num_seqs: int) -> dict:
    """The cached keys a step's XLA:CPU attention reads, by kind, as `ragged_attention` lays them out.

    decode: each decode row's cached tokens; chunks: (cached tokens, new tokens) per prompt chunk. A step of T tokens
    (its bucket) with S = min(T, max_num_seqs) rows: one long chunk (the multi-token row with the longest cache, if it
    is >= T/8 of the step and T > 64) has its cached keys scored against all T tokens (`long_reads` = T x its
    cache); every other token is sorted by its row's cache and cut into groups (the S longest, then the rest; one
    group up to 64 tokens), each walking, for all its tokens, the key blocks its longest needs (`group_reads`)."""
    total = len(decode) + sum(n for _, n in chunks)
    T = round_up(total, token_buckets)
    S = min(T, max_num_seqs)
    long_i, long_len = -1, 0
    if T > SMALL_STEP:
        eligible = [(s, i) for i, (s, n) in enumerate(chunks) if n > 1 and n * LONG_ROW_SHARE >= T]
        if eligible:
            long_len, long_i = max(eligible)
    lens = sorted([c for c in decode] + [s for i, (s, n) in enumerate(chunks) if i != long_i for _ in range(n)],
                  reverse=True)  # tokens' cached keys; padding and the long row's tokens read none here

    def walk(n_tokens, longest):
        return n_tokens * -(-longest // BLOCK_KEYS) * BLOCK_KEYS

    if T > SMALL_STEP and S < T:
        group_reads = walk(S, lens[0] if lens else 0) + walk(T - S, lens[S] if len(lens) > S else 0)
    else:
        group_reads = walk(T, lens[0] if lens else 0)
    return {"bucket": T, "group_reads": group_reads, "long_reads": T * long_len}


@dataclasses.dataclass
class StepCosts:
    """Measured on this machine: a step's seconds = base[its bucket] + per-read seconds x `attention_work`."""
    base: dict[int, float]  # token bucket -> seconds, nothing cached
    per_group_read: float
    per_long_read: float
    max_num_seqs: int
    overhead_s: float = 0.0  # per step, beyond the measured dispatch-to-fetch (a server's host work it cannot hide)

    def __post_init__(self):
        self.base = {int(k): float(v) for k, v in self.base.items()}
        self.token_buckets = tuple(sorted(self.base))

    def seconds(self, decode: list[int], chunks: list[tuple[int, int]]) -> float:
        w = attention_work(decode, chunks, self.token_buckets, self.max_num_seqs)
        return (self.base[w["bucket"]] + self.per_group_read * w["group_reads"]
                + self.per_long_read * w["long_reads"] + self.overhead_s)

    def to_json(self) -> dict:
        return {"base_s": {str(k): round(v, 5) for k, v in self.base.items()},
                "per_group_read_s": self.per_group_read, "per_long_read_s": self.per_long_read}

    @classmethod
    def load(cls, path) -> tuple["StepCosts", dict]:
        d = json.loads(Path(path).read_text())
        return cls(d["base_s"], d["per_group_read_s"], d["per_long_read_s"], d["max_num_seqs"]), d


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float  # between a prefill and a decode replica (the KV transfer)


# Inputs of the projection (the brief's figures; links: v5e ICI ~45 GB/s per direction of one link, H100 NVLink 4
# 450 GB/s per direction, both one host).
ACCELERATORS = {
    "v5e": Accelerator("v5e", 197e12, 819e9, 16e9, 45e9),
    "h100": Accelerator("h100", 989e12, 3.35e12, 80e9, 450e9),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    matmul_params: float  # weights multiplied per token (all but the embedding table)
    weight_bytes: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_elem: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem


# Llama 3 8B in bf16 (jaxserve.aot.deviceless.MODEL_CONFIGS["llama-3-8b"]): 8.03 B parameters, of which the
# 128256 x 4096 embedding table is only looked up; the LM head (the same size) is a matmul.
LLAMA3_8B = ModelShape("llama-3-8b", 8.03e9 - 128256 * 4096, 2 * 8.03e9, 32, 32, 8, 128)


@dataclasses.dataclass
class RooflineCosts:
    """A step on `devices` chips of `acc` (tensor parallel, collectives free): the larger of its FLOPs at `mfu` of
    peak and its bytes (weights once, each row's cached K/V, the new K/V) at `mbu` of bandwidth, plus `overhead_s`.
    Steps are not padded to buckets."""
    acc: Accelerator
    model: ModelShape
    devices: int = 1
    mfu: float = 0.5
    mbu: float = 0.8
    overhead_s: float = 0.5e-3
    token_buckets: tuple = None

    def seconds(self, decode: list[int], chunks: list[tuple[int, int]]) -> float:
        m = self.model
        tokens = len(decode) + sum(n for _, n in chunks)
        # query-key pairs: a decode row sees its context and itself; a chunk its cache and (causally) itself
        pairs = sum(c + 1 for c in decode) + sum(n * s + n * (n + 1) / 2 for s, n in chunks)
        flops = 2 * m.matmul_params * tokens + 4 * m.num_layers * m.num_heads * m.head_dim * pairs
        kv_read = sum(decode) + sum(s for s, _ in chunks)
        bytes_ = m.weight_bytes + m.kv_bytes_per_token * (kv_read + tokens)
        return max(flops / (self.acc.peak_flops * self.mfu), bytes_ / (self.acc.hbm_bytes_per_s * self.mbu)) \
            / self.devices + self.overhead_s

    def kv_tokens(self, utilization: float = 0.9) -> int:
        return int((self.acc.hbm_bytes * self.devices * utilization - self.model.weight_bytes)
                   / self.model.kv_bytes_per_token)


# ---- the simulation ----

@dataclasses.dataclass(eq=False)
class Seq:
    arrival: float
    prompt: int
    output: int  # tokens to generate (the first included)
    index: int = 0
    computed: int = 0  # tokens whose K/V is in this replica's cache
    generated: int = 0
    pages: int = 0
    kv_ready: bool = False  # handed off: its K/V arrives with it (until a preemption drops it)
    running: bool = False  # in its replica's running list
    first_token: float | None = None
    finish: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.generated

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.finish - self.first_token) / (self.output - 1) if self.output > 1 else None


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclasses.dataclass
class Plan:
    decode: list  # sequences
    chunks: list  # [seq, start, length]


class Replica:
    """One engine's scheduler and its device, in simulated time. role: "both", "prefill" or "decode"."""

    def __init__(self, costs, role: str = "both", max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 num_pages: int = 1 << 30, page_size: int = 16, copy_s_per_token: float = 0.0):
        """copy_s_per_token: this replica's own time to export (prefill) or import (decode) a token's K/V."""
        self.costs, self.role, self.copy_s_per_token = costs, role, copy_s_per_token
        self.imported = 0  # tokens of K/V imported by the step being planned
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.free_pages, self.page_size = num_pages, page_size
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.incoming = 0  # hand-offs routed here, still in transfer
        self.busy = False
        self.steps = 0
        self.preemptions = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + self.incoming

    def _grow(self, seq: Seq, tokens: int) -> bool:
        need = -(-tokens // self.page_size) - seq.pages
        if need <= 0:
            return True
        while need > self.free_pages:
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += need
            self.free_pages -= need
        return True

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        seq.running = False
        self.free_pages += seq.pages
        seq.pages, seq.computed = 0, 0  # recomputed from its tokens when admitted again (on whichever side)
        self.preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def _admit(self, seq: Seq) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        need = pages_for(seq.num_tokens, self.page_size)
        if need > self.free_pages:
            return False
        seq.pages, self.free_pages = need, self.free_pages - need
        if seq.kv_ready:  # a hand-off: its K/V imported into the pages, only its last token left to compute
            seq.computed, seq.kv_ready = seq.num_tokens - 1, False
            self.imported += seq.computed
        self.waiting.remove(seq)
        bisect.insort(self.running, seq, key=lambda s: s.arrival)  # kept in priority (fcfs) order
        seq.running = True
        return True

    def plan(self) -> Plan:
        plan, budget, preemptions = Plan([], []), self.budget, self.preemptions
        for seq in list(self.running):
            if seq.running and seq.num_tokens - seq.computed == 1 and self._grow(seq, seq.num_tokens):
                plan.decode.append(seq)
                budget -= 1
        plan.decode = [s for s in plan.decode if s.running]
        for seq in self.running:
            if budget > 0 and seq.num_tokens - seq.computed > 1:
                n = min(seq.num_tokens - seq.computed, budget)
                plan.chunks.append([seq, seq.computed, n])
                budget -= n
        # Admitted: a new prompt's first chunk; a hand-off's last token (a one-token "chunk" that samples, as the
        # scheduler plans it), so it decodes in the step it is admitted in.
        for seq in list(self.waiting) if self.preemptions == preemptions else []:
            if budget <= 0 or not self._admit(seq):
                break
            n = min(seq.num_tokens - seq.computed, budget)
            plan.chunks.append([seq, seq.computed, n])
            budget -= n
        self._fit_to_bucket(plan)
        return plan

    def _fit_to_bucket(self, plan: Plan) -> None:
        buckets = getattr(self.costs, "token_buckets", None)
        total = len(plan.decode) + sum(c[2] for c in plan.chunks)
        if not buckets or total == 0:
            return
        above = round_up(total, buckets)
        below = max((b for b in buckets if b < total), default=0)
        if above <= SMALL_STEP or above - total <= above // 4 or below < max(len(plan.decode), 1):
            return
        excess = total - below
        while excess > 0:
            cut = min(excess, plan.chunks[-1][2])
            plan.chunks[-1][2] -= cut
            excess -= cut
            if plan.chunks[-1][2] == 0:
                plan.chunks.pop()

    def seconds(self, plan: Plan) -> float:
        imported, self.imported = self.imported, 0
        return self.costs.seconds([s.num_tokens - 1 for s in plan.decode],
                                  [(start, n) for _, start, n in plan.chunks]) + imported * self.copy_s_per_token

    def apply(self, plan: Plan, now: float) -> tuple[list[Seq], list[Seq]]:
        """The step's tokens land: returns (sequences that got a token, hand-offs)."""
        self.steps += 1
        landed, handoffs = [], []
        for seq in plan.decode:
            seq.computed += 1
            seq.generated += 1
            landed.append(seq)
        for seq, start, n in plan.chunks:
            seq.computed = start + n
            if seq.computed == seq.num_tokens:  # the last chunk samples the next token
                seq.generated += 1
                landed.append(seq)
        for seq in landed:
            if seq.generated == seq.output:
                self._release(seq)
            elif self.role == "prefill":
                self._release(seq)
                handoffs.append(seq)
        return landed, handoffs

    def _release(self, seq: Seq) -> None:
        self.running.remove(seq)
        seq.running = False
        self.free_pages += seq.pages
        seq.pages = 0


@dataclasses.dataclass
class Setup:
    """colocated replicas, or prefill and decode pools (with their own costs) and the transfer between them."""
    name: str
    costs: object  # colocated replicas' (or both pools', unless prefill_costs / decode_costs say otherwise)
    colocated: int = 1
    prefill: int = 0
    decode: int = 0
    prefill_costs: object = None
    decode_costs: object = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    num_pages: int = 1 << 30  # per replica
    page_size: int = 16
    kv_bytes_per_token: float = 0.0
    kv_bytes_per_s: float = 1e9
    kv_fixed_s: float = 0.0
    kv_copy_bytes_per_s: float = math.inf  # each side's own gather / scatter (and encode / decode) of the pages
    hop_s: float = 0.0  # a router's relay, on every token of a disaggregated setup
    devices_per_replica: int = 1

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def devices(self) -> int:
        return (self.prefill + self.decode if self.disaggregated else self.colocated) * self.devices_per_replica

    def replicas(self):
        def make(costs, role):
            return Replica(costs, role, self.max_num_seqs, self.max_num_batched_tokens, self.num_pages,
                           self.page_size, self.kv_bytes_per_token / self.kv_copy_bytes_per_s)
        if not self.disaggregated:
            return [make(self.costs, "both") for _ in range(self.colocated)], []
        return ([make(self.prefill_costs or self.costs, "prefill") for _ in range(self.prefill)],
                [make(self.decode_costs or self.costs, "decode") for _ in range(self.decode)])

    def transfer_s(self, seq: Seq) -> float:
        return self.kv_fixed_s + seq.prompt * self.kv_bytes_per_token / self.kv_bytes_per_s


def simulate(setup: Setup, requests: list[tuple[float, int, int]], replicas=None) -> list[Seq]:
    """requests: (arrival s, prompt tokens, output tokens). Returns them as finished Seqs (TTFT, TPOT), in order.
    replicas: (front, back) as `setup.replicas()` makes them (default: new ones), to look at afterwards."""
    front, back = replicas or setup.replicas()
    seqs = [Seq(a, p, o, i) for i, (a, p, o) in enumerate(requests)]
    hop = setup.hop_s if setup.disaggregated else 0.0
    events, order = [], 0  # (time, order, kind, payload): order keeps ties first-in first-out

    def push(t, kind, payload):
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    def start(replica, now):
        plan = replica.plan()
        if not plan.decode and not plan.chunks:
            replica.busy = False
            return
        replica.busy = True
        push(now + replica.seconds(plan), "step", (replica, plan))

    def enqueue(replica, seq, now):
        bisect.insort(replica.waiting, seq, key=lambda s: s.arrival)
        if not replica.busy:
            start(replica, now)

    for seq in seqs:
        push(seq.arrival, "arrival", seq)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrival":
            enqueue(min(front, key=lambda r: r.load), payload, now)
        elif kind == "resume":
            start(payload, now)
        elif kind == "transfer":
            replica, seq = payload
            replica.incoming -= 1
            enqueue(replica, seq, now)
        else:
            replica, plan = payload
            landed, handoffs = replica.apply(plan, now)
            for seq in landed:
                if seq.first_token is None:
                    seq.first_token = now + hop
                if seq.generated == seq.output:
                    seq.finish = now + hop
            export_s = 0.0  # the prefill replica gathers the pages before its next step
            for seq in handoffs:
                seq.kv_ready = True
                export_s += (seq.num_tokens - 1) * replica.copy_s_per_token
                target = min(back, key=lambda r: r.load)
                target.incoming += 1
                push(now + export_s + setup.transfer_s(seq), "transfer", (target, seq))
            if export_s > 0:
                push(now + export_s, "resume", replica)  # busy until then
            else:
                start(replica, now)
    unfinished = [s for s in seqs if s.finish is None]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished (a request larger than a replica's KV cache?)")
    return seqs


def summarize(seqs: list[Seq], ttft_slo: float | None, tpot_slo: float | None) -> dict:
    """The run's figures as bench_pd reports them (over first arrival to last token)."""
    span = max(s.finish for s in seqs) - min(s.arrival for s in seqs)
    tpot = [s.tpot for s in seqs if s.tpot is not None]
    good = sum((ttft_slo is None or s.ttft <= ttft_slo) and (tpot_slo is None or s.tpot is None or s.tpot <= tpot_slo)
               for s in seqs)
    return {"requests": len(seqs), "seconds": round(span, 3), "requests_per_s": round(len(seqs) / span, 4),
            "output_tok_s": round(sum(s.output for s in seqs) / span, 2),
            "ttft_s": percentiles([s.ttft for s in seqs]), "tpot_s": percentiles(tpot),
            "goodput": {"requests_per_s": round(good / span, 4), "fraction": round(good / len(seqs), 4),
                        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo}}


def trace(num_requests: int, seed: int, rate: float, prompt_len, output_len) -> list[tuple[float, int, int]]:
    """bench_pd's requests: the same generator, seed and lengths (prompt tokens as targeted)."""
    return [(r.arrival, len(r.prompt_token_ids), r.max_tokens)
            for r in synth_requests(num_requests, seed, prompt=prompt_len, output=output_len, request_rate=rate)]


# ---- this machine: the setups bench_pd measures ----

def cpu_setups(args) -> list[Setup]:
    both, meta = StepCosts.load(args.costs)
    one, one_meta = StepCosts.load(args.core_costs) if args.core_costs else (both, meta)
    for costs, m, cores in ((both, meta, 2), (one, one_meta, 1)):
        costs.overhead_s = args.cpu_step_overhead_ms / 1e3
        if m["cores"] != cores:
            print(f"note: {m['command']} ran on {m['cores']} cores; its costs stand in for a server on {cores}")
    kv = dict(kv_bytes_per_token=meta["kv_bytes_per_token"], kv_bytes_per_s=args.kv_gbs * 1e9,
              kv_copy_bytes_per_s=args.kv_copy_gbs * 1e9,
              kv_fixed_s=args.kv_fixed_ms / 1e3, hop_s=args.hop_ms / 1e3,
              num_pages=args.kv_cache_bytes // (meta["kv_bytes_per_token"] * 16), page_size=16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    return [Setup("colocated", both, **kv), Setup("disaggregated 1P1D", one, prefill=1, decode=1, **kv)]


def run_cpu(args) -> dict:
    setups = cpu_setups(args)
    measured = json.loads(Path(args.compare).read_text()) if args.compare else None
    if measured:  # the measured run's load and SLOs, not this command's
        m = measured["args"]
        args.rates = sorted({r["request_rate"] for r in measured["runs"]})
        args.num_requests, args.seed, args.prompt_len, args.output_len = \
            m["num_requests"], m["seed"], tuple(m["prompt_len"]), tuple(m["output_len"])
        args.ttft_slo, args.tpot_slo = measured["slo"]["ttft_s"], measured["slo"]["tpot_s"]
    rows = []
    for setup in setups:
        for rate in args.rates:
            reqs = trace(args.num_requests, args.seed, rate, args.prompt_len, args.output_len)
            if measured:  # replay what was sent: the prompts' token counts as the server counted them
                run = find_run(measured, setup, rate)
                if run and run.get("requests"):
                    reqs = [(r["sent"], r["prompt_tokens"] or p, r["max_tokens"])
                            for r, (_, p, _) in zip(run["requests"], reqs)]
            seqs = simulate(setup, reqs)
            rows.append({"setup": setup.name, "request_rate": rate, **summarize(seqs, args.ttft_slo, args.tpot_slo)})
    out = {"rows": rows}
    if measured:
        out["compare"] = compare(rows, measured, args.tolerance)
    return out


def find_run(measured: dict, setup: Setup, rate: float) -> dict | None:
    kind = "disaggregated" if setup.disaggregated else "colocated"
    return next((r for r in measured["runs"] if r["setup"] == kind and math.isclose(r["request_rate"], rate)), None)


COMPARED = (("ttft_s", "p50"), ("ttft_s", "p95"), ("tpot_s", "p50"), ("tpot_s", "p95"), ("goodput", "requests_per_s"))


def compare(rows: list[dict], measured: dict, tolerance: float) -> list[dict]:
    """Each simulated figure against bench_pd's at the same setup and rate: the ratio, and whether it is within
    `tolerance` (0.2: 20%)."""
    out = []
    for row in rows:
        setup = Setup(row["setup"], None, prefill=int(row["setup"] != "colocated"))
        run = find_run(measured, setup, row["request_rate"])
        if run is None:
            continue
        for key, q in COMPARED:
            sim, real = row[key].get(q), run[key].get(q)
            if sim is None or real is None:
                continue
            ratio = sim / real if real else (1.0 if sim == 0 else math.inf)
            out.append({"setup": row["setup"], "request_rate": row["request_rate"], "figure": f"{key} {q}",
                        "measured": real, "simulated": sim, "ratio": round(ratio, 3),
                        "within": abs(ratio - 1) <= tolerance})
    return out


# ---- projection: an 8B model on accelerators ----

def attainment(setup: Setup, rate_per_device: float, args) -> float:
    rate = rate_per_device * setup.devices
    n = min(max(args.proj_requests, int(args.proj_seconds * rate)), args.proj_max_requests)
    seqs = simulate(setup, trace(n, args.seed, rate, args.prompt_len, args.output_len))
    ttft_slo, tpot_slo = args.slo[setup.costs.acc.name]
    return sum(s.ttft <= ttft_slo and (s.tpot is None or s.tpot <= tpot_slo) for s in seqs) / len(seqs)


def max_rate(setup: Setup, args, lo: float = 0.0, hi: float = None) -> float:
    """The highest per-device arrival rate meeting --attainment (bisection; 0 if even a trickle misses)."""
    hi = hi or args.proj_max_rate
    if attainment(setup, hi, args) >= args.attainment:
        return hi
    for _ in range(args.bisections):
        mid = (lo + hi) / 2
        if attainment(setup, mid, args) >= args.attainment:
            lo = mid
        else:
            hi = mid
    return lo


def projection_setups(acc: Accelerator, args, prefill: int, decode: int) -> Setup:
    costs = RooflineCosts(acc, LLAMA3_8B, args.tp[acc.name], args.mfu, args.mbu, args.step_overhead_ms / 1e3)
    page = 16
    return Setup(f"{acc.name} {prefill}P{decode}D" if prefill else f"{acc.name} colocated x{decode}", costs,
                 colocated=decode, prefill=prefill, decode=decode, max_num_seqs=args.proj_max_num_seqs,
                 max_num_batched_tokens=args.proj_max_num_batched_tokens, num_pages=costs.kv_tokens() // page,
                 page_size=page, kv_bytes_per_token=LLAMA3_8B.kv_bytes_per_token,
                 kv_bytes_per_s=acc.link_bytes_per_s, kv_fixed_s=args.proj_kv_fixed_ms / 1e3,
                 devices_per_replica=args.tp[acc.name])


def run_projection(args) -> dict:
    out = {}
    for name in args.accelerators:
        acc = ACCELERATORS[name]
        t = time.perf_counter()
        colocated = {n: max_rate(projection_setups(acc, args, 0, n), args) for n in args.colocated_replicas}
        grid = {}
        for p in range(1, args.max_replicas + 1):
            for d in range(1, args.max_replicas + 1):
                if p + d <= args.max_replicas * (2 if args.full_grid else 1):
                    grid[f"{p}P{d}D"] = max_rate(projection_setups(acc, args, p, d), args)
        best = max(grid, key=grid.get)
        p, d = (int(x) for x in best[:-1].split("P"))
        best_c = max(colocated, key=colocated.get)
        top = min(args.proj_max_rate, 1.6 * max(grid[best], colocated[best_c])) or args.proj_max_rate
        rates = np.linspace(top / args.curve_points, top, args.curve_points)  # up to past both knees
        curves = {f"colocated x{best_c}": [attainment(projection_setups(acc, args, 0, best_c), r, args) for r in rates],
                  f"{best} (best split)": [attainment(projection_setups(acc, args, p, d), r, args) for r in rates],
                  "1P1D": [attainment(projection_setups(acc, args, 1, 1), r, args) for r in rates]}
        out[name] = {"accelerator": dataclasses.asdict(acc), "devices_per_replica": args.tp[name],
                     "slo": {"ttft_s": args.slo[name][0], "tpot_s": args.slo[name][1]},
                     "colocated_goodput_per_device": colocated, "disaggregated_goodput_per_device": grid,
                     "best_split": best, "best_split_goodput_per_device": grid[best],
                     "best_colocated_goodput_per_device": colocated[best_c],
                     "gain": round(grid[best] / colocated[best_c], 3) if colocated[best_c] else None,
                     "curves": {"rate_per_device": rates.round(4).tolist(),
                                **{k: [round(x, 4) for x in v] for k, v in curves.items()}},
                     "seconds": round(time.perf_counter() - t, 1)}
        print(f"{name}: colocated {colocated}; best split {best} {grid[best]:.3f} req/s/device "
              f"({out[name]['gain']}x the best colocated); {out[name]['seconds']} s", flush=True)
    return out


def plot(projection: dict, path: Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(projection)
    fig, axes = plt.subplots(2, len(names), figsize=(6.2 * len(names), 9.5), squeeze=False)
    for col, name in enumerate(names):
        p = projection[name]
        ax = axes[0][col]
        rates = p["curves"]["rate_per_device"]
        for label, ys in p["curves"].items():
            if label != "rate_per_device":
                ax.plot(rates, [100 * y for y in ys], "o-", ms=3, label=label)
        ax.axhline(100 * args.attainment, color="gray", ls=":", lw=1)
        ax.set_xlabel("arrival rate per device (req/s)")
        ax.set_ylabel("requests meeting both SLOs (%)")
        ax.set_title(f"{name} x{p['devices_per_replica']} per replica, 8B bf16: TTFT <= {p['slo']['ttft_s']} s, "
                     f"TPOT <= {p['slo']['tpot_s'] * 1e3:g} ms", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        n = args.max_replicas
        grid = np.full((n, n), np.nan)
        for key, v in p["disaggregated_goodput_per_device"].items():
            pp, dd = (int(x) for x in key[:-1].split("P"))
            grid[pp - 1, dd - 1] = v / p["best_colocated_goodput_per_device"] \
                if p["best_colocated_goodput_per_device"] else np.nan
        im = ax.imshow(grid, origin="lower", cmap="RdBu", vmin=0, vmax=2, extent=(0.5, n + 0.5, 0.5, n + 0.5))
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j + 1, i + 1, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xlabel("decode replicas")
        ax.set_ylabel("prefill replicas")
        ax.set_title(f"goodput per device, P:D split (P + D <= {n}) / best colocated (>1: disaggregation pays)",
                     fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"Simulated (scripts/simulate_pd.py): prompts {args.prompt_len}, outputs {args.output_len} tokens "
                 f"(median, min, max); per-device goodput = the highest rate with >= {args.attainment:.0%} "
                 "meeting both SLOs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> None:
    print(f"{'setup':<22}{'rate':>6}{'req/s':>7}{'out tok/s':>10}{'goodput':>9}{'met':>6}"
          f"{'TTFT p50/p95/p99 s':>22}{'TPOT p50/p95/p99 ms':>22}")
    for r in rows:
        t, o = r["ttft_s"], r["tpot_s"]
        print(f"{r['setup']:<22}{r['request_rate']:>6g}{r['requests_per_s']:>7.3f}{r['output_tok_s']:>10.1f}"
              f"{r['goodput']['requests_per_s']:>9.3f}{r['goodput']['fraction']:>6.0%}"
              f"{'/'.join(f'{t[k]:.2f}' for k in ('p50', 'p95', 'p99')):>22}"
              f"{'/'.join(f'{o[k] * 1e3:.0f}' for k in ('p50', 'p95', 'p99')):>22}")


def parse_slo(s: str) -> dict:
    """'v5e=0.5:0.025,h100=0.2:0.012' -> {name: (ttft_s, tpot_s)}."""
    out = {}
    for part in s.split(","):
        name, v = part.split("=")
        ttft, tpot = v.split(":")
        out[name] = (float(ttft), float(tpot))
    return out


def parse_ints(s: str) -> dict:
    return {k: int(v) for k, v in (p.split("=") for p in s.split(","))}


def main(argv=None):
    from bench_serving import parse_floats, parse_lengths
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rates", type=parse_floats, default=[0.03, 0.06, 0.12], help="req/s (this machine's setups)")
    ap.add_argument("--prompt-len", type=parse_lengths, default=(1400, 1024, 2048), help="MEDIAN,MIN,MAX tokens")
    ap.add_argument("--output-len", type=parse_lengths, default=(128, 64, 256), help="MEDIAN,MIN,MAX tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=float, default=20.0, help="seconds (this machine's setups)")
    ap.add_argument("--tpot-slo", type=float, default=0.3, help="seconds (this machine's setups)")
    ap.add_argument("--costs", default=str(HERE / "bench_results" / "step_costs_2core.json"),
                    help="measure_step_costs.py's JSON for the colocated server (both cores)")
    ap.add_argument("--core-costs", default=str(HERE / "bench_results" / "step_costs_1core.json"),
                    help="... for a server pinned to one core (the prefill and decode servers); '' = --costs")
    ap.add_argument("--cpu-step-overhead-ms", type=float, default=0.0,
                    help="added to every measured step (a server's host work the lookahead does not hide)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="per server (jaxserve's CPU default)")
    ap.add_argument("--kv-gbs", type=float, default=1.0, help="KV transfer GB/s between the two servers "
                    "(scripts/bench_kv_transfer.py measures it)")
    ap.add_argument("--kv-fixed-ms", type=float, default=5.0, help="per-transfer fixed cost (fetch round trip)")
    ap.add_argument("--kv-copy-gbs", type=float, default=5.0, help="GB/s at which each server's engine gathers "
                    "(prefill) or scatters (decode) a hand-off's pages, time its steps wait for")
    ap.add_argument("--hop-ms", type=float, default=1.0, help="the router's relay per token")
    ap.add_argument("--compare", default=None, help="bench_pd.py's JSON: replay its requests, set figures against it")
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--project", action="store_true", help="also project an 8B model on --accelerators")
    ap.add_argument("--accelerators", default="v5e,h100")
    ap.add_argument("--tp", type=parse_ints, default={"v5e": 2, "h100": 1},
                    help="devices per replica (8B bf16 = 16 GB does not fit one 16 GB v5e with a KV cache)")
    ap.add_argument("--slo", type=parse_slo, default={"v5e": (0.6, 0.03), "h100": (0.25, 0.012)},
                    help="per accelerator TTFT:TPOT seconds, e.g. v5e=0.6:0.03,h100=0.25:0.012")
    ap.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOPs a step reaches")
    ap.add_argument("--mbu", type=float, default=0.8, help="fraction of HBM bandwidth a step reaches")
    ap.add_argument("--step-overhead-ms", type=float, default=0.5)
    ap.add_argument("--proj-kv-fixed-ms", type=float, default=1.0)
    ap.add_argument("--proj-max-num-seqs", type=int, default=128)
    ap.add_argument("--proj-max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--proj-requests", type=int, default=200, help="at least this many requests per simulation")
    ap.add_argument("--proj-seconds", type=float, default=60, help="... and this many seconds of arrivals, up to")
    ap.add_argument("--proj-max-requests", type=int, default=600)
    ap.add_argument("--proj-max-rate", type=float, default=16.0, help="req/s per device, the bisection's top")
    ap.add_argument("--bisections", type=int, default=7)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--max-replicas", type=int, default=8, help="P and D from 1 to this, P + D <= it")
    ap.add_argument("--full-grid", action="store_true", help="every P, D up to --max-replicas (P + D <= 2x)")
    ap.add_argument("--colocated-replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--curve-points", type=int, default=16)
    ap.add_argument("--plot", default=None, help="PNG of the projection (needs --project)")
    ap.add_argument("--out", default="bench_results/simulate_pd.json")
    args = ap.parse_args(argv)
    args.accelerators = args.accelerators.split(",")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "args": {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}}
    if args.rates:
        cpu = run_cpu(args)
        result["this_machine"] = cpu
        print(f"this machine's setups (SLOs: TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo * 1e3:g} ms):")
        table(cpu["rows"])
        if "compare" in cpu:
            c = cpu["compare"]
            print(f"\nagainst {args.compare}: {sum(x['within'] for x in c)} of {len(c)} figures within "
                  f"{args.tolerance:.0%}")
            for x in c:
                print(f"  {x['setup']:<22}{x['request_rate']:>6g} {x['figure']:<24} measured {x['measured']:<9g} "
                      f"simulated {x['simulated']:<9g} x{x['ratio']:.2f}{'' if x['within'] else '  OUTSIDE'}")
    if args.project:
        result["projection"] = run_projection(args)
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(result["projection"], Path(args.plot), args)
            print(f"wrote {args.plot}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
