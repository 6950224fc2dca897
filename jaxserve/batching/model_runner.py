"""The device side as the host loop sees it: params, the KV cache, the jitted steps and their buckets.

Steps are dispatched without waiting (JAX runs them asynchronously); `fetch` is the one blocking device-to-host
copy, of the sampled tokens of everything dispatched in one engine step. Each running sequence owns a slot in a
small device buffer of last sampled tokens, so a decode row can take its input token from the step before it
without that token ever visiting the host first.
"""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

from jaxserve.batching.batch_builder import Row, build_batch
from jaxserve.buckets import Buckets, round_up
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.steps import steps_for

logger = logging.getLogger("jaxserve")


class ModelRunner:
    def __init__(self, config, params, dtype, num_pages: int, page_size: int, buckets: Buckets, num_slots: int,
                 attention_backend: str = "reference", kv_cache_dtype: str = "auto"):
        self.config = config
        self.params = params
        self.page_size = page_size
        self.buckets = buckets
        self.steps = steps_for(config, dtype, attention_backend)
        self.kv_cache = init_kv_cache(config, num_pages, page_size, dtype, kv_cache_dtype)
        self.last_tokens = jnp.zeros(num_slots + 1, jnp.int32)  # [slots + 1]: the last one takes padding rows

    def dispatch_prefill(self, row: Row) -> tuple[int, dict]:
        """Starts one chunk of one sequence's prompt; returns a handle for `fetch`."""
        tokens = round_up(len(row.token_ids), self.buckets.prefill_tokens)
        pages = round_up(pages_needed(row.start_pos, self.page_size), self.buckets.num_pages)
        return self._dispatch(self.steps.prefill, [row], 1, tokens, pages)

    def dispatch_decode(self, rows: list[Row]) -> tuple[int, dict]:
        """Starts one new token for each row; returns a handle for `fetch`."""
        seqs = round_up(len(rows), self.buckets.num_seqs)
        pages = round_up(pages_needed(max(r.start_pos for r in rows), self.page_size), self.buckets.num_pages)
        return self._dispatch(self.steps.decode, rows, seqs, 1, pages)

    def fetch(self, handles: list[tuple[int, dict]]) -> list[dict]:
        """Waits for the dispatched steps and copies what they sampled to the host, all in one transfer."""
        keys = ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs")
        # Whole arrays, cut to the real rows on the host: slicing a device array would compile a small program
        # for every new (bucket, rows) pair while serving.
        fetched = jax.device_get([{k: out[k] for k in keys if k in out} for _, out in handles])
        return [{k: v[:n] for k, v in got.items()} for (n, _), got in zip(handles, fetched)]

    def prefill(self, row: Row) -> dict:
        return self.fetch([self.dispatch_prefill(row)])[0]

    def decode(self, rows: list[Row]) -> dict:
        return self.fetch([self.dispatch_decode(rows)])[0]

    def _dispatch(self, step, rows, num_rows, tokens_per_row, pages_per_row) -> tuple[int, dict]:
        batch = build_batch(rows, self.page_size, self.config.vocab_size, num_rows, tokens_per_row, pages_per_row)
        batch["last_tokens"] = self.last_tokens
        out, self.kv_cache = step(self.params, self.kv_cache, batch)
        self.last_tokens = self.steps.store_tokens(self.last_tokens, batch["out_slot"], out["tokens"])
        if not any(r.sampling.want_top_logprobs for r in rows):
            out = {k: v for k, v in out.items() if not k.startswith("top_")}
        return len(rows), out

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
            self.fetch([self._dispatch(step, [row] * num_rows, num_rows, tokens, pages)])
        compiled = self.steps.num_compiled() - before
        logger.info("warm-up compiled %d programs (%d shapes) in %.1f s", compiled, len(shapes),
                    time.perf_counter() - start)
        return compiled
