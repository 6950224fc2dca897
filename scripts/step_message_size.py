"""Bytes one published step takes in a multi-process run (jaxserve.multihost.encode: the page table only as wide as
its rows use) against the whole step at full page-table width (what a pickle of the batch, the format before, took).

    python scripts/step_message_size.py [--json scripts/bench_results/step_message_size.json]

Decode steps of max_num_seqs sequences, each with `context` tokens cached; no device work, so it runs anywhere.
"""
import argparse
import json
import pickle

from jaxserve.buckets import Buckets, round_up
from jaxserve.cache import pages_needed
from jaxserve.multihost import StepMessage, encode
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch

# (what, max_num_seqs, max_num_batched_tokens, block_size, max_model_len, context)
CASES = [("defaults, 1,000-token contexts", 64, 512, 16, 8192, 1000),
         ("defaults, 8,000-token contexts", 64, 512, 16, 8192, 8000),
         ("256 seqs x 128k, 4,000-token contexts", 256, 512, 16, 131072, 4000),
         ("256 seqs x 128k, full contexts", 256, 512, 16, 131072, 131000)]


def message_bytes(max_num_seqs, max_num_batched_tokens, block_size, max_model_len, context) -> tuple[int, int, int]:
    buckets = Buckets.for_limits(max_num_seqs, max_num_batched_tokens, pages_needed(max_model_len, block_size))
    per_row = pages_needed(context + 1, block_size)
    rows = [Row([1], context, list(range(1 + i * per_row, 1 + (i + 1) * per_row)),
                RowSampling(temperature=0.7, seed=i), slot=i, chained=True) for i in range(max_num_seqs)]
    tokens = round_up(len(rows), buckets.num_tokens)
    batch = build_batch(rows, block_size, 49152, tokens, buckets.num_rows(tokens), buckets.pages_per_row)
    full = len(pickle.dumps(("step", 0, batch)))
    return full, len(encode(StepMessage(0, batch), 0, b"s" * 32)), buckets.pages_per_row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="scripts/bench_results/step_message_size.json")
    args = parser.parse_args()
    results = []
    print(f"{'case':40} {'table width':>11} {'full width KB':>14} {'sent KB':>9}")
    for what, *shape in CASES:
        full, sent, width = message_bytes(*shape)
        results.append(dict(case=what, shape=shape, page_table_width=width, full_width_bytes=full, sent_bytes=sent))
        print(f"{what:40} {width:11d} {full / 1e3:14.1f} {sent / 1e3:9.1f}")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
