"""The device side as the host loop sees it: params, the KV cache, the jitted steps and their buckets."""
from __future__ import annotations

import logging
import time

import jax

from jaxserve.batching.batch_builder import Row, build_batch
from jaxserve.buckets import Buckets, round_up
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.steps import steps_for

logger = logging.getLogger("jaxserve")


class ModelRunner:
    def __init__(self, config, params, dtype, num_pages: int, page_size: int, buckets: Buckets):
        self.config = config
        self.params = params
        self.page_size = page_size
        self.buckets = buckets
        self.steps = steps_for(config, dtype)
        self.kv_cache = init_kv_cache(config, num_pages, page_size, dtype)

    def prefill(self, row: Row) -> dict:
        """One chunk of one sequence's prompt; returns the host copy of what the step sampled (row 0)."""
        tokens = round_up(len(row.token_ids), self.buckets.prefill_tokens)
        pages = round_up(pages_needed(row.start_pos, self.page_size), self.buckets.num_pages)
        return self._run(self.steps.prefill, [row], 1, tokens, pages)

    def decode(self, rows: list[Row]) -> dict:
        """One new token for each row; returns host arrays, one entry per row."""
        seqs = round_up(len(rows), self.buckets.num_seqs)
        pages = round_up(pages_needed(max(r.start_pos for r in rows), self.page_size), self.buckets.num_pages)
        return self._run(self.steps.decode, rows, seqs, 1, pages)

    def _run(self, step, rows, num_rows, tokens_per_row, pages_per_row) -> dict:
        batch = build_batch(rows, self.page_size, self.config.vocab_size, num_rows, tokens_per_row, pages_per_row)
        out, self.kv_cache = step(self.params, self.kv_cache, batch)
        out = jax.device_get(out)  # the one device-to-host copy of the step
        return {k: v[:len(rows)] for k, v in out.items()}

    def warmup(self, progress: bool = True) -> int:
        """Compiles every bucket before serving; returns how many programs were compiled."""
        shapes = list(self.buckets.shapes())
        before = self.steps.num_compiled()
        start = time.perf_counter()
        iterator = shapes
        if progress:
            from tqdm import tqdm
            iterator = tqdm(shapes, desc="compiling step buckets", unit="shape")
        for kind, num_rows, tokens, pages in iterator:
            # Rows whose pages are all the scratch page: real shapes, no cache content touched.
            row = Row([0] * tokens, 0, [0] * pages_needed(tokens, self.page_size))
            step = self.steps.prefill if kind == "prefill" else self.steps.decode
            self._run(step, [row] * num_rows, num_rows, tokens, pages)
        compiled = self.steps.num_compiled() - before
        logger.info("warm-up compiled %d programs (%d shapes) in %.1f s", compiled, len(shapes),
                    time.perf_counter() - start)
        return compiled
