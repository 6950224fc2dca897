"""Decode roofline per chip and model: the tokens per second a decode step cannot beat, from the bytes it must move.

An estimate from what the compiled programs hold, not a measurement. A decode step of R rows reads every weight
once (as stored: int8 a byte a weight, int4 with its scales and offsets) and each row's KV pages (as stored: on TPU
head_dim padded to 128 lanes; a sliding-window layer reads only the window), so its time is at least
bytes / HBM bandwidth and its rate at most R / that; compute (2 flops per weight per row / the chip's dense bf16
peak) binds only far above 64 rows. `--audit` adds what the HBM audit (`jaxserve.aot.hbm_audit`) found the compiled
step moving beyond that (from an `aot_check.py --out` JSON of the same models, scaled from its layers to the
model's), so a copy the compiler inserts shows as a lower ceiling.

    python scripts/roofline.py --out roofline.json --plot docs/roofline.png
    python scripts/roofline.py --audit aot.json   # aot.json: aot_check.py --num-layers 2 ... --out aot.json

Beside the ceilings, published peer figures (PEERS: engine, chips, rows, context, decode rate) are set against the
same ceiling computed for their configuration (weights and KV split over their tensor-parallel chips, collectives
free), so each reads as a fraction of what its chips could do.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax.numpy as jnp

from jaxserve.aot import deviceless as aot
from jaxserve.aot.collectives import Collective
from jaxserve.cache import bytes_per_page
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.weights.params import param_bytes

CASES = [("llama-3-8b", None), ("llama-3-8b", "int8"), ("gemma-3-1b", None), ("smollm2-135m", None)]

@dataclasses.dataclass(frozen=True)
class Peer:
    """A published decode rate: `rows` sequences decoding at about `context` tokens each on `chips` chips at tensor
    parallelism `chips`; tokens_per_s is rows / the reported inter-token latency where one is reported (a decode
    step's rate, as the ceiling is), else the reported output throughput."""
    engine: str
    model: str
    quantization: str | None
    chip: str
    chips: int
    rows: int
    context: int
    tokens_per_s: float
    source: str
    kv_cache_dtype: str = "auto"


PEERS = [
    # Llama-3.1-8B-Instruct bf16, TP 4, 16 concurrent requests of 512 in / 512 out (context ~768 mid-decode),
    # median TPOT 9.84 ms (output throughput 1,448.9 tok/s).
    Peer("sglang-jax 0.1.0", "llama-3-8b", None, "v6e", 4, 16, 768, 16 / 9.84e-3,
         "github.com/sgl-project/sglang-jax docs/cookbook/autoregressive/Llama/Llama3.1.md"),
    # Qwen3-8B bf16, TP 4, 1024 in / 1024 out (context ~1.5k mid-decode), ITL at batch 16 and 64 (2025-09-12).
    Peer("sglang-jax", "qwen3-8b", None, "v6e", 4, 16, 1536, 16 / 6.62e-3,
         "sglang-jax docs: Performance Benchmark Results, TPU-v6e-4, Qwen3-8B 1024/1024"),
    Peer("sglang-jax", "qwen3-8b", None, "v6e", 4, 64, 1536, 64 / 11.11e-3, "same table, batch 64"),
    Peer("vLLM TPU", "qwen3-8b", None, "v6e", 4, 16, 1536, 16 / 9.98e-3, "same table (vLLM main of 2025-09)"),
    Peer("vLLM TPU", "qwen3-8b", None, "v6e", 4, 64, 1536, 64 / 18.34e-3, "same table, batch 64"),
    # Llama 3 8B, TP 8 on v5e-8, ShareGPT prompts in a 2048-token cache (context taken as 1k), output throughput.
    Peer("JetStream-PyTorch", "llama-3-8b", None, "v5e", 8, 128, 1024, 8249,
         "github.com/AI-Hypercomputer/jetstream-pytorch benchmarks (2024-04-24)"),
    Peer("JetStream-PyTorch", "llama-3-8b", "int8", "v5e", 8, 256, 1024, 10873, "same table, int8 weights and KV",
         "int8"),
]


def kv_bytes_per_row(config, context: int, lanes: int, kv_cache_dtype: str = "auto") -> float:
    """KV bytes one decode row reads at this context: every layer's pages up to its window."""
    per_token_layer = bytes_per_page(config, 16, jnp.bfloat16, kv_cache_dtype, lanes) / 16 / config.num_layers
    read = sum(min(context, config.layer_window(i) or context) for i in range(config.num_layers))
    return per_token_layer * read


def audit_extra(audit_rows, model, quantization, chip, rows) -> float:
    """The audit's extra bytes of that model's decode step of `rows` rows on a chip: a layer's findings scaled from
    the compiled layers to the model's, the rest (the embedding, the cache) once."""
    for r in audit_rows:
        if (r["model"] == model and r["target"].split(":")[0] == chip and r["program"] == "step"
                and r["shape"] == f"{rows} tokens x {rows} rows" and r.get("tp", 1) == 1
                and r.get("quantization") == quantization):
            scale = aot.MODEL_CONFIGS[model].num_layers / r["num_layers"]
            return sum(Collective.array_bytes((t["array"]["dtype"], t["array"]["dims"]))
                       * (scale if t["of"].startswith("layers_") else 1) for t in r.get("traffic", []))
    return 0.0


@dataclasses.dataclass(frozen=True)
class Ceiling:
    tokens_per_s: float  # the whole slice's: rows / step seconds
    bytes: float  # one chip's bytes a step
    bound: str  # "memory" or "compute"


@functools.lru_cache(maxsize=None)
def model_bytes(model: str, quantization: str | None) -> tuple[float, float]:
    """(bytes of the weights as stored, the number of weights)."""
    config = aot.MODEL_CONFIGS[model]
    return (param_bytes(aot.abstract_params(config, jnp.bfloat16, quantization)),
            param_bytes(aot.abstract_params(config, jnp.bfloat16)) / 2)


def ceiling(model: str, quantization: str | None, chip: str, rows: int, context: int, *, chips: int = 1,
            extra_bytes: float = 0.0, kv_cache_dtype: str = "auto") -> Ceiling:
    """The decode rate a step of `rows` rows at `context` tokens cannot beat on `chips` chips of tensor
    parallelism: each chip reads its share of the weights and of the KV pages (collectives counted free)."""
    config, spec = aot.MODEL_CONFIGS[model], aot.CHIPS[chip]
    weights, params = model_bytes(model, quantization)
    lanes = page_head_dim_multiple("pallas-" + spec.platform)
    moved = (weights + rows * kv_bytes_per_row(config, context, lanes, kv_cache_dtype)) / chips + extra_bytes
    memory, compute = moved / spec.hbm_bandwidth, 2 * params * rows / chips / spec.peak_flops
    return Ceiling(rows / max(memory, compute), moved, "memory" if memory >= compute else "compute")


def print_ceilings(args, audit_rows) -> list[dict]:
    table = []
    print(f"{'model':<22} {'chip':<5} " + " ".join(
        f"{f'{r}x{c // 1024}k':>9}" for r in args.rows for c in args.context) + "   (tokens/s, upper bound)")
    for model, quantization in CASES:
        name = model + (f" {quantization}" if quantization else "")
        for chip in aot.CHIPS:
            cells = []
            for rows in args.rows:
                for context in args.context:
                    c = ceiling(model, quantization, chip, rows, context,
                                extra_bytes=audit_extra(audit_rows, model, quantization, chip, rows))
                    cells.append(c.tokens_per_s)
                    table.append(dict(model=name, chip=chip, rows=rows, context=context, bytes=c.bytes,
                                      tokens_per_s=c.tokens_per_s, bound=c.bound))
            print(f"{name:<22} {chip:<5} " + " ".join(f"{x:9.0f}" for x in cells))
    return table


def print_peers() -> list[dict]:
    print(f"\n{'peer':<18} {'model':<16} {'chips':<6} {'rows':>4} {'ctx':>5} {'tok/s':>7} {'ceiling':>8} {'share':>6}")
    out = []
    for p in PEERS:
        c = ceiling(p.model, p.quantization, p.chip, p.rows, p.context, chips=p.chips,
                    kv_cache_dtype=p.kv_cache_dtype)
        name = p.model + (f" {p.quantization}" if p.quantization else "")
        print(f"{p.engine:<18} {name:<16} {f'{p.chip}-{p.chips}':<6} {p.rows:4d} {p.context:5d} "
              f"{p.tokens_per_s:7.0f} {c.tokens_per_s:8.0f} {p.tokens_per_s / c.tokens_per_s:6.0%}")
        out.append(dict(dataclasses.asdict(p), ceiling=c.tokens_per_s, share=p.tokens_per_s / c.tokens_per_s))
    return out


def plot(path: str, contexts: list[int]) -> None:
    """Llama 3 8B bf16 ceilings per chip against rows, with the Llama peers per chip of their slice (at tensor
    parallelism t a slice's ceiling is t times one chip's at the same rows, collectives aside)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [2 ** i for i in range(9)]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for chip, color in zip(aot.CHIPS, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for context, style in zip(contexts, ("-", "--", ":")):
            ax.plot(rows, [ceiling("llama-3-8b", None, chip, r, context).tokens_per_s for r in rows], style,
                    color=color, label=f"{chip} ceiling, {context // 1024}k context")
        for p in PEERS:
            if p.chip == chip and p.model == "llama-3-8b" and p.quantization is None:
                ax.plot(p.rows, p.tokens_per_s / p.chips, "o", color=color, markersize=7)
                ax.annotate(f"{p.engine}\n({chip}-{p.chips}, per chip)", (p.rows, p.tokens_per_s / p.chips),
                            textcoords="offset points", xytext=(6, -18), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="decode rows per step", ylabel="tokens/s per chip",
           title="Llama 3 8B bf16 decode: ceiling from bytes per step (estimate), and peers")
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--audit", help="an aot_check.py --out JSON whose audit findings to add")
    p.add_argument("--out")
    p.add_argument("--plot", help="write a PNG of the Llama 3 8B ceilings and peers here (needs matplotlib)")
    args = p.parse_args()
    audit_rows = json.load(open(args.audit))["rows"] if args.audit else []
    table = print_ceilings(args, audit_rows)
    peers = print_peers()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": table, "peers": peers}, f, indent=1)
    if args.plot:
        plot(args.plot, args.context)


if __name__ == "__main__":
    main()
