"""What each weight and KV-cache format costs in quality, on the default model and a fixed public-domain text.

    python scripts/eval_quality.py [--model M] [--text tests/data/alice_ch1.txt] [--tokens N] [--formats a,b,...]
                                   [--out bench_results/quality.json]

Per format: perplexity of the text and top-1 (greedy) agreement with float32, the share of positions where the
format's most likely next token is float32's. Weights are scored with one prefill of the text; the KV-cache
format with prefills of a page (16 tokens) at a time, so nearly every key is read back from the cache as decode
reads it. AWQ calibrates on jaxserve/data/calibration.txt (another chapter of the same book).
"""
import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.model.quant import quantize_params
from jaxserve.quantize.awq import CALIBRATION_TEXT, quantize_awq
from jaxserve.quantize.perplexity import next_token_logits, perplexity
from jaxserve.weights import load_model
from jaxserve.weights.params import param_bytes

FORMATS = {  # name: (convert the float32 params, keyword arguments for scoring)
    "float32": (lambda loaded: loaded.params, {}),
    "bfloat16": (lambda loaded: jax.tree.map(lambda a: a.astype(jnp.bfloat16), loaded.params),
                 {"dtype": jnp.bfloat16}),
    "int8": (lambda loaded: quantize_params(loaded.params, "int8"), {}),
    "int4": (lambda loaded: quantize_params(loaded.params, "int4"), {}),  # groups of 32
    "int4-g128": (lambda loaded: quantize_params(loaded.params, "int4", group_size=128), {}),
    "awq-g128": (lambda loaded: quantize_awq(loaded.config, loaded.params,
                                             loaded.tokenizer.encode(CALIBRATION_TEXT.read_text()), 128), {}),
    "int8-kv": (lambda loaded: loaded.params, {"kv_cache_dtype": "int8", "chunk": 16}),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model; e.g. gemma3-270m")
    ap.add_argument("--text", default=str(Path(__file__).parent.parent / "tests" / "data" / "alice_ch1.txt"))
    ap.add_argument("--tokens", type=int, default=None, help="score only the first N tokens")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, from: " + ", ".join(FORMATS))
    ap.add_argument("--out", default="bench_results/quality.json")
    args = ap.parse_args()
    names = args.formats.split(",")
    if unknown := set(names) - set(FORMATS):
        ap.error(f"unknown formats {sorted(unknown)}")
    loaded = load_model(args.model, jnp.float32)
    ids = loaded.tokenizer.encode(Path(args.text).read_text())[:args.tokens]
    rows, reference = [], None
    for name in ["float32"] + [n for n in names if n != "float32"]:
        convert, score = FORMATS[name]
        start = time.perf_counter()
        params = convert(loaded)
        logits = next_token_logits(loaded.config, params, ids, **score)
        top1 = logits.argmax(-1)
        reference = top1 if reference is None else reference
        rows.append({"format": name, "weight_bytes": param_bytes(params),
                     "perplexity": round(perplexity(logits, ids), 4),
                     "top1_agreement": round(float((top1 == reference).mean()), 4),
                     "seconds": round(time.perf_counter() - start, 1)})
    base = rows[0]["perplexity"]
    print(f"{loaded.name}: {len(ids)} tokens of {Path(args.text).name}")
    print(f"{'format':<12}{'MB':>8}{'perplexity':>12}{'vs fp32':>9}{'top-1 agree':>13}")
    for r in rows:
        print(f"{r['format']:<12}{r['weight_bytes'] / 1e6:>8.0f}{r['perplexity']:>12.3f}"
              f"{100 * (r['perplexity'] / base - 1):>+8.1f}%{100 * r['top1_agreement']:>12.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": loaded.name, "text": Path(args.text).name,
                               "tokens": len(ids),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
