"""Warm-up: every program a runner's steps may run, compiled before serving, so that serving compiles nothing.

A program is compiled for each shape its inputs take: each step bucket (tokens, rows) at each table width, plain and
(with speculation) verifying, on the base model and (with LoRA) on the adapters; a split step's sampling half
(structured output, `jaxserve.runner.steps.Steps.sample_joined`) for each row bucket; a disaggregated pool's page
transfers for each page-count bucket; the program that fills a LoRA slot. The steps run over the scratch page only.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from jaxserve.runner.batch_builder import warmup_rows

logger = logging.getLogger("jaxserve")


def warm_up(runner, progress: bool = True, time_steps: bool = False) -> int:
    """Compiles runner's (a `jaxserve.runner.model_runner.ModelRunner`) programs; returns how many were compiled.
    time_steps: also time each shape once compiled (into runner.step_times)."""
    k = runner.num_speculative_tokens
    shapes = [(t, r, 0) for t, r in runner.buckets.shapes()]
    shapes += [(t, r, k) for t, r in runner.buckets.shapes() if k and t > 1]  # a verification row has 2 tokens
    before = runner.steps.num_compiled()
    start = time.perf_counter()
    iterator = shapes
    if progress:
        from tqdm import tqdm
        iterator = tqdm(shapes, desc="compiling step buckets", unit="shape")
    for tokens, num_rows, num_draft in iterator:
        rows = warmup_rows(tokens, num_rows, num_draft, runner.page_size)
        # With LoRA, the adapters' program too: the same rows on slot 0 (zeros or an adapter; the scratch page's
        # content is never read back).
        variants = [rows] + ([[dataclasses.replace(r, lora_slot=0) for r in rows]] if runner.lora is not None else [])
        for batch_rows in variants:
            for width in runner.buckets.widths():  # the tables' widths are the same programs' shapes
                runner.fetch(runner.dispatch(batch_rows, width))
        if time_steps:  # the fastest of a few: one page fault or GC pause must not set a cost for good
            runner.step_times[tokens, 1 + k if num_draft else 1] = min(_time(runner, rows) for _ in range(3))
    if runner.splits_sampling:
        _warm_split_sampling(runner)
    compiled = runner.steps.num_compiled() - before
    if runner.kv_transfer:  # after the steps: the cache is a program's output now, as it is while serving
        before_transfer = runner.transfer_compiled()
        runner._warm_transfer()
        compiled += runner.transfer_compiled() - before_transfer
    if runner.lora is not None and not runner.lora_compiled():
        # The slot-filling program too, so that loading an adapter never compiles (no slot was ever filled,
        # so slot 0 is empty already).
        runner.clear_lora(0)
        compiled += 1
    logger.info("warm-up compiled %d programs (%d shapes) in %.1f s", compiled, len(shapes),
                time.perf_counter() - start)
    return compiled


def _warm_split_sampling(runner) -> None:
    """A split step's sampling half for each row bucket, once: its first half is the step's own forward program,
    compiled above, run here over the fewest tokens that make those rows."""
    fewest: dict[int, int] = {}
    for tokens, num_rows in runner.buckets.shapes():
        fewest[num_rows] = min(tokens, fewest.get(num_rows, tokens))
    for num_rows, tokens in sorted(fewest.items()):
        handle = runner.dispatch(warmup_rows(tokens, num_rows, 0, runner.page_size), runner.buckets.widths()[0],
                                 masks_later=True)
        runner.join_masks(handle, None)
        runner.fetch(handle)


def _time(runner, rows) -> float:
    start = time.perf_counter()
    runner.fetch(runner.dispatch(rows))
    return time.perf_counter() - start
