"""What the engine loop needs of the device side: start a step over rows, read it back, compile ahead.

`ModelRunner` is the real one (a jitted step over a paged KV cache); tests drive the scheduler and the engine loop
with a fake whose tokens can be worked out by hand (`tests/fake_runner.py`), and inject faults there.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jaxserve.batch import StepOutput
from jaxserve.cache.transfer import KVPages
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.runner.batch_builder import Row


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its output still on the device (or in flight), and how many of its rows are real."""
    num_rows: int
    output: StepOutput | None  # None until a split step's masks are joined (`Runner.join_masks`)
    forward: Any = None  # a split step's forward, on device, until its masks are joined


class Runner(Protocol):
    # Seconds per step by (tokens, tokens scored per row), measured at warm-up: what speculation's controller weighs.
    step_times: dict[tuple[int, int], float]
    # The page counts a transfer of pages is padded to (export_pages, put_pages), ascending: disaggregated pools move
    # each once at warm-up, so no transfer compiles while serving.
    page_buckets: tuple[int, ...]

    @property
    def splits_sampling(self) -> bool:
        """Whether a step may be split (`dispatch(masks_later=True)`): the forward dispatched before some rows'
        token masks are known, the sampling once they are (`join_masks`). A runner that cannot ignores masks_later."""

    def dispatch(self, rows: list[Row], *, masks_later: bool = False) -> StepHandle:
        """Starts a step over `rows` without waiting for it. masks_later: the rows sample only once `join_masks`
        brings more of their masks (the grammar masks of structured output: a split step)."""

    def join_masks(self, handle: StepHandle, masks) -> None:
        """A split step's rows sampled under masks (int32 [rows, ceil(V / 32)]; None: all -1) ANDed with their own;
        dispatched, not waited for. Must come before the handle is waited for or read back, and before the next
        step is dispatched."""

    def wait(self, handle: StepHandle, until: float | None = None) -> bool:
        """Blocks until a dispatched step has run, copying nothing (fetch then returns at once), or until
        time.perf_counter() passes `until` if given (no longer than about a millisecond past it); True if it has
        run."""

    def fetch(self, handle: StepHandle) -> StepOutput:
        """Waits for a dispatched step; its output on the host, cut to its rows."""

    def export_pages(self, page_ids: list[int]) -> KVPages:
        """The K/V of pages page_ids (dispatched, not waited for; perhaps padded past them)."""

    def pages_bytes(self, num_tokens: int) -> int:
        """Bytes the pages of num_tokens tokens take in this runner's cache (bounds a transfer of them)."""

    def put_pages(self, kv: KVPages) -> KVPages:
        """kv moved to where this runner's cache lives (a copy started, not waited for)."""

    def import_pages(self, page_ids: list[int], kv: KVPages) -> None:
        """Writes kv's first len(page_ids) pages at page_ids, before any step dispatched after."""

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes an adapter's arrays into device slot `slot` (LoRASlots decides which): the steps dispatched after
        run rows naming the slot with it, those dispatched before with the slot's old contents. ValueError for a slot
        out of range or an adapter that does not fit."""

    def warmup(self, progress: bool = True, time_steps: bool = False) -> int:
        """Compiles every step shape before serving; returns how many programs were compiled."""
