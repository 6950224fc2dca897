"""What structured output costs: the host's mask fill per row, and decode speed with constrained rows in the batch.

    python scripts/bench_structured_output.py [--rows 1,8,64] [--batch-sizes 1,64] [--constrained 0,8,64]
                                              [--model gemma3-270m] [--steps 8] [--repeats 3] [--skip-fill]
                                              [--out scripts/bench_results/structured_output.json]

Mask fill: `jaxserve.structured_output.fill_masks` (llguidance's parallel fill, without the GIL) over R matchers of
a JSON schema, each at its own place in a document of that schema (a generation's states, not one state R times),
for SmolLM2's vocabulary (49k tokens) and Gemma 3's (262k): microseconds per row = time of one fill / R, the median
over the document's steps (goal <= 100 us).

Decode: tok/s of the default model (or --model, e.g. gemma3-270m) with B sequences after a 16-token prompt, of which
C follow a JSON schema whose language is long (an array of at least 50 records, so no sequence finishes while
measured); tok/s = B x steps / time of `steps` engine steps (host loop included: reading back, the output processor,
the masks, the step). Each configuration against the unconstrained one, measured in the same run with the
configurations interleaved (goal >= 0.9x at 64 rows). A batch holding constrained rows runs split steps (the next
forward dispatched before the step in flight is read back, the masks joined on device: `jaxserve.batching.
engine_core`), so this measures that too.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
from bench_decode import machine  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.sampling_params import StructuredOutputsParams  # noqa: E402
from jaxserve.structured_output import compile_grammar, fill_masks  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402
from jaxserve.weights import resolve_model_path  # noqa: E402
from jaxserve.weights.gguf import open_gguf  # noqa: E402

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "email", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
DOCUMENT = json.dumps([{"name": f"Zoë Person {i}", "age": 20 + i, "email": f"user{'x' * (i % 5)}@mail.com",
                        "tags": ["red", "blue"][:i % 3]} for i in range(60)],
                      separators=(", ", ": "), ensure_ascii=False)


def bench_fill(tokenizer: Tokenizer, rows: list[int], steps: int = 200) -> dict[int, float]:
    grammar = compile_grammar(StructuredOutputsParams(json=SCHEMA), tokenizer, tokenizer.vocab_size)
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    result = {}
    for r in rows:
        matchers = [grammar.matcher() for _ in range(r)]
        starts = [(i * 37) % (len(ids) - steps - 1) for i in range(r)]  # each row at its own place
        for m, s in zip(matchers, starts):
            assert all(m.accept(t) for t in ids[:s])
        fill_masks(matchers)  # the lexer's first states
        times = []
        for step in range(steps):
            t = time.perf_counter()
            fill_masks(matchers)
            times.append(time.perf_counter() - t)
            for m, s in zip(matchers, starts):
                assert m.accept(ids[s + step])
        result[r] = round(statistics.median(times) / r * 1e6, 1)
    return result


def bench_decode(batch_sizes: list[int], constrained: list[int], model: str | None = None, prompt_len: int = 16,
                 steps: int = 8, repeats: int = 3) -> list[dict]:
    """tok/s of each (batch, constrained rows) configuration, the configurations of a batch size interleaved
    (plain, 8, 64, plain, 8, 64, ...: `repeats` rounds, the median of each), so that the machine's load weighs on
    each alike."""
    # A KV budget for the few tokens each run holds, not the default 2 GiB: the machine's memory is shared.
    llm = LLM(model, max_model_len=1024, max_num_seqs=max(batch_sizes), max_num_batched_tokens=512, warmup=False,
              kv_cache_memory_bytes=512 << 20)
    prompt = {"prompt_token_ids": peers._prompt_ids(prompt_len, llm.config.vocab_size)}
    # Room for the steps that prefill the batch (the first sequences decode meanwhile) and the measured ones.
    plain = SamplingParams(temperature=0, max_tokens=1024 - prompt_len, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=plain.max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    runs: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        for b in batch_sizes:
            for c in sorted({min(c, b) for c in constrained}):
                runs.setdefault((b, c), []).append(_decode_run(llm, prompt, b, c, plain, schema, steps))
    rows = [{"batch": b, "constrained": c, "decode_tok_s": round(statistics.median(r), 1), "runs": r}
            for (b, c), r in runs.items()]
    for row in rows:
        base = next(r for r in rows if r["batch"] == row["batch"] and r["constrained"] == 0)
        row["vs_unconstrained"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
    return rows


def _decode_run(llm, prompt, b: int, c: int, plain, schema, steps: int) -> float:
    """tok/s of `steps` decode steps of b sequences, c of them under the schema."""
    requests = [llm.add_request(prompt, schema if i < c else plain) for i in range(b)]
    while any(s.num_to_compute > 1 for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    for _ in range(3):
        llm.step()  # this batch's decode bucket compiled, and the pipeline (or not) settled
    t = time.perf_counter()
    for _ in range(steps):
        llm.step()
    tok_s = b * steps / (time.perf_counter() - t)
    ended = [(s.finish_reason, s.text[-80:]) for r in requests for s in r.seqs if s.finished]
    assert not ended, f"a sequence ended while measured: {ended}"
    for r in requests:
        llm.abort_request(r.request_id)
    while llm.has_unfinished_requests():
        llm.step()
    return round(tok_s, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--constrained", default="0,8,64")
    ap.add_argument("--model", default=None, help="decode model (default: the default model; e.g. gemma3-270m)")
    ap.add_argument("--steps", type=int, default=8, help="measured decode steps a run")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the interleaved configurations")
    ap.add_argument("--skip-fill", action="store_true", help="decode only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "bench_results" / "structured_output.json"))
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    vocabularies = {"SmolLM2 (49k)": resolve_model_path(None), "Gemma 3 (262k)": resolve_model_path("gemma3-270m")}
    fill = {}
    for name, path in ({} if args.skip_fill else vocabularies).items():
        fill[name] = bench_fill(Tokenizer.from_gguf_fields(open_gguf(path)), ints(args.rows))
    print("\nHost mask fill (llguidance's parallel fill), microseconds per row")
    print(f"{'vocabulary':<16}" + "".join(f"{f'{r} rows':>10}" for r in ints(args.rows)))
    for name, per_rows in fill.items():
        print(f"{name:<16}" + "".join(f"{per_rows[r]:>10}" for r in ints(args.rows)))
    decode = bench_decode(ints(args.batch_sizes), ints(args.constrained), args.model, steps=args.steps,
                          repeats=args.repeats)
    print(f"\nDecode, {args.model or 'default model'} (tok/s, host loop included; configurations interleaved)")
    print(f"{'batch':>6}{'constrained':>13}{'tok/s':>10}{'vs none':>9}")
    for r in decode:
        print(f"{r['batch']:>6}{r['constrained']:>13}{r['decode_tok_s']:>10}{r['vs_unconstrained']:>9}")
    out = {"mask_fill_us_per_row": fill, "decode": decode, "decode_model": args.model or "default", "schema": SCHEMA,
           "machine": machine()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
