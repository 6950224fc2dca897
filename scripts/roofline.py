"""Decode roofline per chip and model: the tokens per second a decode step cannot beat, from the bytes it must move.

An estimate from what the compiled programs hold, not a measurement. A decode step of R rows reads every weight
once (as stored: int8 a byte a weight, int4 with its scales and offsets) and each row's KV pages (as stored: on TPU
head_dim padded to 128 lanes; a sliding-window layer reads only the window), so its time is at least
bytes / HBM bandwidth and its rate at most R / that; compute (2 flops per weight per row / the chip's dense bf16
peak) binds only far above 64 rows. `--audit` adds what the HBM audit (`jaxserve.hbm_audit`) found the compiled
step moving beyond that (from an `aot_check.py --out` JSON of the same models, scaled from its layers to the
model's), so a copy the compiler inserts shows as a lower ceiling.

    python scripts/roofline.py --out roofline.json
    python scripts/roofline.py --audit aot.json   # aot.json: aot_check.py --num-layers 2 ... --out aot.json
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp

from jaxserve import aot
from jaxserve.cache import bytes_per_page
from jaxserve.collectives import Collective
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.weights.params import param_bytes

CASES = [("llama-3-8b", None), ("llama-3-8b", "int8"), ("gemma-3-1b", None), ("smollm2-135m", None)]


def kv_bytes_per_row(config, context: int, lanes: int) -> float:
    """KV bytes one decode row reads at this context: every layer's pages up to its window."""
    per_token_layer = bytes_per_page(config, 16, jnp.bfloat16, "auto", lanes) / 16 / config.num_layers
    read = sum(min(context, config.layer_window(i) or context) for i in range(config.num_layers))
    return per_token_layer * read


def audit_extra(audit_rows, model, chip, rows) -> float:
    """The audit's extra bytes of that model's decode step of `rows` rows on a chip: a layer's findings scaled from
    the compiled layers to the model's, the rest (the embedding, the cache) once."""
    for r in audit_rows:
        if (r["model"] == model and r["target"].split(":")[0] == chip and r["program"] == "step"
                and r["shape"] == f"{rows} tokens x {rows} rows"):
            scale = aot.MODEL_CONFIGS[model].num_layers / r["num_layers"]
            return sum(Collective.array_bytes((t["array"]["dtype"], t["array"]["dims"]))
                       * (scale if t["of"].startswith("layers_") else 1) for t in r.get("traffic", []))
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--audit", help="an aot_check.py --out JSON whose audit findings to add")
    p.add_argument("--out")
    args = p.parse_args()
    audit_rows = json.load(open(args.audit))["rows"] if args.audit else []
    table = []
    print(f"{'model':<22} {'chip':<5} {'weights GB':>10} " + " ".join(
        f"{f'{r}x{c // 1024}k':>9}" for r in args.rows for c in args.context) + "   (tokens/s, upper bound)")
    for model, quantization in CASES:
        config = aot.MODEL_CONFIGS[model]
        weights = param_bytes(aot.abstract_params(config, jnp.bfloat16, quantization))
        params = param_bytes(aot.abstract_params(config, jnp.bfloat16)) / 2  # weights, counted as bf16 ones
        name = model + (f" {quantization}" if quantization else "")
        for chip, spec in aot.CHIPS.items():
            lanes = page_head_dim_multiple("pallas-" + spec.platform)
            cells = []
            for rows in args.rows:
                for context in args.context:
                    moved = weights + rows * kv_bytes_per_row(config, context, lanes) + audit_extra(
                        audit_rows, model, chip, rows)
                    seconds = max(moved / spec.hbm_bandwidth, 2 * params * rows / spec.peak_flops)
                    cells.append(rows / seconds)
                    table.append(dict(model=name, chip=chip, rows=rows, context=context, bytes=moved,
                                      tokens_per_s=rows / seconds, bound="memory" if moved / spec.hbm_bandwidth
                                      >= 2 * params * rows / spec.peak_flops else "compute"))
            print(f"{name:<22} {chip:<5} {weights / 1e9:10.2f} " + " ".join(f"{c:9.0f}" for c in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
