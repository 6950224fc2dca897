"""What each weight format costs in quality, on the default model and a fixed public-domain text.

    python scripts/eval_quality.py [--text tests/data/gettysburg.txt] [--out bench_results/quality.json]

For float32, bfloat16, int8 and int4 weights: perplexity of the text (one prefill, next-token log-probabilities)
and top-1 agreement with float32 (the share of positions where the format's most likely next token is float32's).
Formats still to come (int4 + AWQ, int8 KV cache) are listed as not measured.
"""
import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.perplexity import next_token_logits, perplexity
from jaxserve.quant import quantize_params
from jaxserve.weights import load_model
from jaxserve.weights.params import param_bytes

FORMATS = {
    "float32": lambda params: params,
    "bfloat16": lambda params: jax.tree.map(lambda a: a.astype(jnp.bfloat16), params),
    "int8": lambda params: quantize_params(params, "int8"),
    "int4": lambda params: quantize_params(params, "int4"),
}
NOT_YET = ["int4+awq", "int8 kv cache"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=str(Path(__file__).parent.parent / "tests" / "data" / "gettysburg.txt"))
    ap.add_argument("--out", default="bench_results/quality.json")
    args = ap.parse_args()
    loaded = load_model(None, jnp.float32)
    ids = loaded.tokenizer.encode(Path(args.text).read_text())
    rows, reference = [], None
    for name, convert in FORMATS.items():
        params = convert(loaded.params)
        dtype = jnp.bfloat16 if name == "bfloat16" else jnp.float32
        logits = next_token_logits(loaded.config, params, ids, dtype)
        top1 = logits.argmax(-1)
        reference = top1 if reference is None else reference
        rows.append({"format": name, "weight_bytes": param_bytes(params), "perplexity": round(perplexity(logits, ids), 4),
                     "top1_agreement": round(float((top1 == reference).mean()), 4)})
    base = rows[0]["perplexity"]
    print(f"{len(ids)} tokens of {Path(args.text).name}")
    print(f"{'format':<12}{'MB':>8}{'perplexity':>12}{'vs fp32':>9}{'top-1 agree':>13}")
    for r in rows:
        print(f"{r['format']:<12}{r['weight_bytes'] / 1e6:>8.0f}{r['perplexity']:>12.3f}"
              f"{100 * (r['perplexity'] / base - 1):>+8.1f}%{100 * r['top1_agreement']:>12.1f}%")
    print("not measured yet: " + ", ".join(NOT_YET))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "text": Path(args.text).name, "tokens": len(ids),
                               "rows": rows, "not_measured": NOT_YET}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
