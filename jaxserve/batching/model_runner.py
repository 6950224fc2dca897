"""The device side as the host loop sees it: params, the KV cache, the jitted step and its buckets.

A step is dispatched without waiting (JAX runs it asynchronously); `fetch` is the one blocking device-to-host copy,
of what it sampled. Each running sequence owns a slot in a small device buffer of last sampled tokens, so a decode
row can take its input token from the step before it without that token ever visiting the host first.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from jaxserve.batch import StepInput, StepOutput
from jaxserve.batching.batch_builder import Row, build_batch, plan_rows
from jaxserve.buckets import Buckets, round_up
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.distributed import log_placement, param_specs, place, replicated, shardings
from jaxserve.steps import steps_for

logger = logging.getLogger("jaxserve")


class ModelRunner:
    def __init__(self, config, params, dtype, num_pages: int, page_size: int, buckets: Buckets, num_slots: int,
                 attention_backend: str = "reference", kv_cache_dtype: str = "auto", num_speculative_tokens: int = 0,
                 mesh=None):
        """num_speculative_tokens: k, for verification programs (a target's; a draft model's runner has none: it
        draws its proposals in plain steps). mesh: the device group to split the model and its cache over (None:
        the default device)."""
        self.config = config
        self.page_size = page_size
        self.buckets = buckets
        self.num_speculative_tokens = num_speculative_tokens
        self.mesh = mesh
        self.steps = steps_for(config, dtype, attention_backend, num_speculative_tokens, mesh, kv_cache_dtype)
        self.draft: ModelRunner | None = None  # a target's draft model's runner
        if mesh is None:
            self.params = params
            self.kv_cache = init_kv_cache(config, num_pages, page_size, dtype, kv_cache_dtype)
            self.last_tokens = jnp.zeros(num_slots + 1, jnp.int32)  # [slots + 1]: the last one takes padding rows
        else:
            tp = mesh.shape["model"]
            self.params = place(params, shardings(mesh, param_specs(params, self.steps.partitioning, tp)))
            log_placement("weights", self.params)
            # Made where they live: the cache never exists whole on one device.
            self.kv_cache = jax.jit(lambda: init_kv_cache(config, num_pages, page_size, dtype, kv_cache_dtype),
                                    out_shardings=self.steps.cache_sharding)()
            log_placement("KV cache", self.kv_cache)
            def zeros(shape, dtype):  # replicated, made on every device of the group (of every process)
                return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=replicated(mesh))()
            self.last_tokens = zeros(num_slots + 1, jnp.int32)
        # Seconds per step by (tokens, scored per row), measured at warm-up: what speculation's controller weighs.
        self.step_times: dict[tuple[int, int], float] = {}
        # A multi-process leader's: where each dispatched batch is published, and this runner's index there.
        self.channel, self.channel_index = None, 0

    def dispatch(self, plan) -> tuple[int, StepOutput]:
        """Starts the step of a scheduler's plan; returns a handle for `fetch`."""
        return self.dispatch_rows(plan_rows(plan))

    def dispatch_rows(self, rows: list[Row]) -> tuple[int, StepOutput]:
        tokens = round_up(sum(len(r.token_ids) for r in rows), self.buckets.num_tokens)
        scored = self.num_speculative_tokens + 1 if any(r.num_draft for r in rows) else 1
        batch = build_batch(rows, self.page_size, self.config.vocab_size, tokens, self.buckets.num_rows(tokens),
                            self.buckets.pages_per_row, scored)
        if self.channel is None:
            out = self.run(batch)
        else:  # a multi-process leader: every process runs the same step (jaxserve.multihost)
            self.channel.send(("step", self.channel_index, batch))
            try:
                out = self.run(batch)
            except BaseException as e:  # the followers run it regardless: no later step could line up
                self.channel.abort(f"process 0 failed a step it had sent to the other processes "
                                   f"({type(e).__name__}: {e})")
        if not any(r.sampling.want_top_logprobs for r in rows):
            out = dataclasses.replace(out, top_ids=None, top_logprobs=None)  # nothing to copy back
        return len(rows), out

    def run(self, batch: StepInput) -> StepOutput:
        """The device side of a step whose batch is built (all a multi-process follower does of it)."""
        out, self.kv_cache, self.last_tokens = self.steps.step(self.params, self.kv_cache, self.last_tokens, batch)
        return out

    def fetch(self, handle: tuple[int, StepOutput]) -> StepOutput:
        """Waits for a dispatched step and copies what it sampled to the host in one transfer, cut to its rows."""
        n, out = handle
        # Whole arrays, cut on the host: slicing a device array would compile a small program for every new
        # (bucket, rows) pair while serving.
        got = jax.device_get(out)
        return jax.tree.map(lambda x: x[:n], got)

    def _time(self, rows: list[Row]) -> float:
        start = time.perf_counter()
        self.fetch(self.dispatch_rows(rows))
        return time.perf_counter() - start

    def warmup(self, progress: bool = True, time_steps: bool = False) -> int:
        """Compiles every bucket before serving (plain and, with speculation, verification programs); returns how
        many programs were compiled. time_steps: also time each shape once compiled (into step_times)."""
        k = self.num_speculative_tokens
        shapes = [(t, r, 0) for t, r in self.buckets.shapes()]
        shapes += [(t, r, k) for t, r in self.buckets.shapes() if k and t > 1]  # a verification row has 2 tokens
        before = self.steps.num_compiled()
        start = time.perf_counter()
        iterator = shapes
        if progress:
            from tqdm import tqdm
            iterator = tqdm(shapes, desc="compiling step buckets", unit="shape")
        for tokens, num_rows, num_draft in iterator:
            # Rows whose pages are all the scratch page: real shapes, no cache content touched.
            per_row, extra = divmod(tokens, num_rows)
            lengths = [per_row + (i < extra) for i in range(num_rows)]
            if num_draft and lengths[0] == 1:  # a verification row needs a proposal after its token
                lengths = [2] + lengths[1:-1]
            drafts = [min(num_draft, lengths[0] - 1)] + [0] * (len(lengths) - 1)
            rows = [Row([0] * n, 0, [0] * pages_needed(n + 1, self.page_size), num_draft=d)
                    for n, d in zip(lengths, drafts)]
            self.fetch(self.dispatch_rows(rows))
            if time_steps:  # the fastest of a few: one page fault or GC pause must not set a cost for good
                self.step_times[tokens, 1 + k if num_draft else 1] = min(self._time(rows) for _ in range(3))
        compiled = self.steps.num_compiled() - before
        logger.info("warm-up compiled %d programs (%d shapes) in %.1f s", compiled, len(shapes),
                    time.perf_counter() - start)
        return compiled
