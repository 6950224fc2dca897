"""The device side as the host loop sees it: params, the KV cache, the jitted step and its buckets.

A step is dispatched without waiting (JAX runs it asynchronously); `fetch` is the one blocking device-to-host copy,
of what it sampled. Each running sequence owns a slot in a small device buffer of last sampled tokens, so a decode
row can take its input token from the step before it without that token ever visiting the host first.

With LoRA (max_loras > 0) the runner also holds the adapters' device buffers (`jaxserve.lora.buffers`): a row's
`lora_slot` names one of them; `load_lora` / `clear_lora` fill and empty a slot by one compiled program (the slot
is an argument), so adapters come and go without a compilation.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.batch import StepInput, StepOutput
from jaxserve.buckets import Buckets, geometric, round_up
from jaxserve.cache import SCRATCH_PAGE, init_kv_cache, pages_needed
from jaxserve.cache.kv_cache import bf16_pages_as_bits, values_dtype
from jaxserve.cache.transfer import KVPages, gather_pages, kv_bytes, num_pages, padded_ids, scatter_pages
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.buffers import SlotArrays, empty_lora, lora_axes
from jaxserve.model.fused import with_fused_projections
from jaxserve.model.quant import Int8Weight, is_quantized, quantize_int8
from jaxserve.multihost import LeaderFollower
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.parallel.layouts import param_formats, with_row_major_tables
from jaxserve.parallel.mesh import log_placement, param_shardings, place, replicated
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.runner.penalty_slots import PenaltySlots
from jaxserve.runner.protocol import StepHandle
from jaxserve.runner.steps import SplitForward, steps_for
from jaxserve.runner.warmup import warm_up

logger = logging.getLogger("jaxserve")

# From this vocabulary size up, an int8 model's LM head is int8 too on CPU (`with_serving_head`).
INT8_HEAD_MIN_VOCAB = 100_000


def with_serving_head(config, params, platform: str):
    """params with the LM head in the format a decode step on `platform` reads fastest: on CPU, an int8 model (its
    layers' kernels Int8Weight) whose vocabulary has at least INT8_HEAD_MIN_VOCAB tokens gets an int8 head too (XLA's
    int8 dot, as its layers: `jaxserve.model.quant.int8_dot_matmul`), where quantize_params leaves the head float unless
    asked (quantize_embeddings). Anything else, and every other platform, keeps its params as they are.

    Measured on the 2 vCPU Sapphire Rapids (2026-12-02, machine shared, variants interleaved in one process):
    Gemma 3 270M's [640, 262144] head, 671 MB of its 1072 float32 bytes a step, at one row 22.1 -> 15.8 ms; the
    int8 engine's batch-1 decode step after a 512-token prompt 40.3 -> 36.6 ms (24.8 -> 27.3 tok/s; 71.2 -> 61.5
    ms with another process on the cores); perplexity on tests/data/alice_ch1.txt (1024 tokens) 23.33 -> 23.42
    (float32 23.42). SmolLM2's 49,152-token head (113 MB) gained nothing at batch 1 (28.98 -> 28.95 ms a step),
    so a small vocabulary keeps its float head.
    """
    p = params["params"]
    head = p["lm_head"]["kernel"]
    int8_layers = any(isinstance(leaf, Int8Weight) for leaf in jax.tree.leaves(
        {k: v for k, v in p.items() if k != "lm_head"}, is_leaf=lambda x: isinstance(x, Int8Weight)))
    if platform != "cpu" or not int8_layers or config.vocab_size < INT8_HEAD_MIN_VOCAB or is_quantized(head):
        return params  # an int8 or int4 head (quantize_embeddings) stays as it was made
    # Compiled, so that its roundings fuse instead of each writing a head-sized temporary.
    return {**params, "params": {**p, "lm_head": {**p["lm_head"], "kernel": jax.jit(quantize_int8)(head)}}}


def served_params(config, params, platform: str, fuse: bool = True):
    """The params a runner on one device serves, what its steps read: the LM head in its serving format
    (`with_serving_head`), the embedding table row-major (`jaxserve.parallel.layouts`), and on CPU each layer's q/k/v
    and gate/up fused (`jaxserve.model.fused`; LoRA adapters add their terms to the fused outputs)."""
    params = with_row_major_tables(with_serving_head(config, params, platform))
    return with_fused_projections(params) if platform == "cpu" and fuse else params


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How a runner lays out a model's steps and cache: all a ModelRunner needs beyond the model itself."""
    dtype: Any  # of the weights and (unless kv_cache_dtype says int8) the KV cache
    num_pages: int
    page_size: int
    buckets: Buckets
    num_slots: int  # rows of the device-side buffer of last sampled tokens: max_num_seqs
    attention_backend: str = "reference"
    kv_cache_dtype: str = "auto"
    # k, for verification programs (a target's; a draft model's runner has none: it draws proposals in plain steps).
    num_speculative_tokens: int = 0
    # LoRA adapter slots on device and their rank (0: no LoRA, and the programs are exactly the base model's).
    max_loras: int = 0
    max_lora_rank: int = 0
    # Warm up the programs that move a sequence's pages out of and into the cache (a disaggregated pool's runner).
    kv_transfer: bool = False
    # Decode context parallelism: the cache split over the mesh by token (page_size is then the host's, d x a device's).
    decode_context_parallel_size: int = 1
    # The layers whose inputs a speculative head reads (`jaxserve.model.head_config`), kept by cache slot.
    capture: tuple[int, ...] = ()


def _trimmed(out: StepOutput, rows: list[Row]) -> StepOutput:
    """out less what no row reads: nothing of it is then copied back."""
    if not any(r.sampling.want_top_logprobs for r in rows):
        out = dataclasses.replace(out, top_ids=None, top_logprobs=None)
    if not any(r.prompt_targets for r in rows):
        out = dataclasses.replace(out, prompt=None)
    return out


class ModelRunner:
    def __init__(self, config, params, rc: RunnerConfig, mesh=None, leader: LeaderFollower | None = None,
                 index: int = 0):
        """mesh: the device group to split the model and its cache over (None: the default device). leader: a
        multi-process leader's protocol, which publishes each step to the followers (as this runner's `index`)
        before it runs here."""
        self.config = config
        self.page_size = rc.page_size
        self.buckets = rc.buckets
        self.num_speculative_tokens = rc.num_speculative_tokens
        self.mesh = mesh
        self.leader, self.index = leader, index
        self.steps = steps_for(config, rc.dtype, rc.attention_backend, rc.num_speculative_tokens, mesh,
                               rc.kv_cache_dtype, rc.decode_context_parallel_size, rc.capture)

        def new_cache():
            return init_kv_cache(config, rc.num_pages, rc.page_size, rc.dtype, rc.kv_cache_dtype,
                                 page_head_dim_multiple(rc.attention_backend),
                                 bf16_pages_as_bits(platform, rc.attention_backend))
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        # The embedding table row-major, where the chip's default is not: its lookup then reads rows in place.
        if mesh is None:
            self.params = served_params(config, params, platform)
            self.kv_cache = new_cache()
            self.last_tokens = jnp.zeros(rc.num_slots + 1, jnp.int32)  # [slots + 1]: the last one takes padding rows
        else:
            self.params = place(params, param_formats(params, self.steps.param_shardings(params)))
            log_placement("weights", self.params)
            # Made where they live: the cache never exists whole on one device.
            self.kv_cache = jax.jit(new_cache, out_shardings=self.steps.cache_sharding)()
            log_placement("KV cache", self.kv_cache)
            # Replicated, made on every device of the group (of every process).
            self.last_tokens = jax.jit(lambda: jnp.zeros(rc.num_slots + 1, jnp.int32),
                                       out_shardings=replicated(mesh))()
        # The penalties' counts per slot, kept on device (made at the first step).
        self.penalties = PenaltySlots(rc.num_slots + 1, config.vocab_size, mesh)
        # [pages x page_size, F]: the captured hidden states of every cached token, by slot (None: no head reads them).
        self.features = None
        if rc.capture:
            shape = (rc.num_pages * rc.page_size, len(rc.capture) * config.hidden_size)
            self.features = (jnp.zeros(shape, rc.dtype) if mesh is None else
                             jax.jit(lambda: jnp.zeros(shape, rc.dtype), out_shardings=self.steps.features_sharding)())
        # Seconds per step by (tokens, scored per row), measured at warm-up: what speculation's controller weighs.
        self.step_times: dict[tuple[int, int], float] = {}
        self.max_loras, self.max_lora_rank, self.dtype = rc.max_loras, rc.max_lora_rank, rc.dtype
        self.lora = None
        if rc.max_loras:
            self._init_lora()
        self._init_transfer(rc.kv_transfer)

    def _init_transfer(self, warm: bool) -> None:
        # Page counts are bucketed like token counts, so moving any sequence's pages runs a program compiled ahead.
        self.page_buckets = geometric(1, self.buckets.pages_per_row)
        self.kv_transfer = warm
        # Where the cache's pages live (over a mesh: split over KV heads), and so where imported pages must go.
        self._page_shardings = jax.tree.map(lambda x: x.sharding, self.kv_cache)
        out: dict[str, Any] = {} if self.mesh is None else dict(out_shardings=self.steps.cache_sharding)
        self._gather = jax.jit(gather_pages, **out)  # its pages keep the cache's sharding
        self._scatter = jax.jit(scatter_pages, donate_argnums=0, **out)

    def export_pages(self, page_ids: list[int]) -> KVPages:
        """The pages page_ids as KVPages, dispatched and not waited for. They hold the next page-count bucket's
        pages: the ones past len(page_ids) are copies of the scratch page. A step dispatched later that
        overwrites these pages (donating the cache) runs after this read, as JAX orders them."""
        size = round_up(len(page_ids), self.page_buckets)
        return self._gather(self.kv_cache, padded_ids(page_ids, size))

    def pages_bytes(self, num_tokens: int) -> int:
        """Bytes the pages of num_tokens tokens take in this cache: the most a transfer of them may carry."""
        return pages_needed(num_tokens, self.page_size) * kv_bytes(self.kv_cache) // num_pages(self.kv_cache)

    def put_pages(self, kv: KVPages) -> KVPages:
        """kv where this cache's pages live, split as they are (a copy started, not waited for), padded to a
        page-count bucket: from host numpy, or another mesh's export (resharded). Raises ValueError for pages of
        another shape or dtype (a cast would import other values than were exported)."""
        kv = [(k, v) for k, v in kv]
        # The ignore: PyTreeDef compares by structure, but mypy sees jaxlib's PyTreeDef unresolved, with no __ne__.
        if (len(kv) != len(self.kv_cache)
                or jax.tree.structure(kv) != jax.tree.structure(self.kv_cache)):  # type: ignore[operator]
            raise ValueError(f"KV pages of {len(kv)} layers ({jax.tree.structure(kv)}) do not fit this cache's "
                             f"{len(self.kv_cache)} ({jax.tree.structure(self.kv_cache)})")
        have = num_pages(kv)
        for x, pages in zip(jax.tree.leaves(kv), jax.tree.leaves(self.kv_cache)):
            if x.shape[0] != have or x.shape[1:] != pages.shape[1:]:
                raise ValueError(f"KV pages of shape {x.shape} do not fit this cache's {pages.shape[1:]} per page")
            if x.dtype != values_dtype(pages):
                raise ValueError(f"KV pages of dtype {x.dtype} do not fit this cache's {values_dtype(pages)}")
        if have > self.page_buckets[-1]:
            raise ValueError(f"{have} KV pages are more than a sequence here can hold ({self.page_buckets[-1]})")
        size = round_up(have, self.page_buckets)
        if size != have:  # a trimmed copy (from the host): padded there, so the import runs a warmed-up program
            kv = jax.tree.map(lambda x: np.concatenate([np.asarray(x), np.zeros((size - have,) + x.shape[1:],
                                                                                   x.dtype)]), kv)
        if self.mesh is None:
            # Uncommitted, as the cache is: a program is compiled for its inputs' committedness, so a committed copy
            # scattered in would commit the cache and make every step compile again after warm-up.
            return jax.tree.map(lambda x: jax.device_put(np.asarray(x) if getattr(x, "committed", False) else x), kv)
        return jax.device_put(kv, self._page_shardings)

    def import_pages(self, page_ids: list[int], kv: KVPages) -> None:
        """Writes kv's first len(page_ids) pages at page_ids (in place; dispatched, not waited for). kv comes from
        anywhere (see put_pages); its pages past len(page_ids) (an export's padding) go to the scratch page."""
        kv = self.put_pages(kv)
        if num_pages(kv) < len(page_ids):
            raise ValueError(f"{len(page_ids)} pages to import, the KV pages hold {num_pages(kv)}")
        self.kv_cache = self._scatter(self.kv_cache, padded_ids(page_ids, num_pages(kv)), kv)

    def transfer_compiled(self) -> int:
        """Programs compiled so far to export and import pages."""
        # The ignore: jit's C++ wrapper has _cache_size; the JitWrapped stub does not declare it.
        return self._gather._cache_size() + self._scatter._cache_size()  # type: ignore[attr-defined]

    def _warm_transfer(self) -> None:
        """Every page-count bucket's export and import, of the scratch page only (no content touched)."""
        for size in self.page_buckets:
            ids = [SCRATCH_PAGE] * size
            self.import_pages(ids, self.export_pages(ids))

    def _init_lora(self):
        def empty():
            return empty_lora(self.config, self.max_loras, self.max_lora_rank, self.dtype)
        if self.mesh is None:
            self.lora, write = empty(), {}
        else:
            # Split like their base kernels, made where they live; a slot's arrays (no slot axis) like one slot.
            spec = param_shardings(self.mesh, jax.eval_shape(empty), lora_axes(self.config))
            self.lora = jax.jit(empty, out_shardings=spec)()
            log_placement("LoRA buffers", self.lora)
            one = jax.tree.map(lambda s: NamedSharding(s.mesh, P(*s.spec[1:])), spec)
            write = dict(in_shardings=(spec, replicated(self.mesh), one), out_shardings=spec)

        def write_slot(lora, slot, arrays):  # slot: a traced int32 scalar, so every slot shares the program
            return jax.tree.map(lambda buf, x: buf.at[slot].set(x), lora, arrays)
        self._write_lora = jax.jit(write_slot, donate_argnums=0, **write)
        self.slot_arrays = SlotArrays(self.config, self.max_lora_rank, self.dtype)

    def prepare_lora(self, adapter: LoRAAdapter) -> None:
        """Builds the adapter's padded slot arrays ahead of load_lora, on the calling thread (any: the host's loader
        calls it where an adapter is loaded, so that the engine thread only writes them to the device)."""
        if self.lora is None:
            raise ValueError("this runner has no LoRA slots (enable_lora is off)")
        self.slot_arrays.prepare(adapter)

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes adapter into device slot `slot` (in place; a step dispatched before runs with the slot's old
        contents). Raises ValueError for a slot out of range or an adapter that does not fit."""
        self._write_slot(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        """Empties device slot `slot` (all zeros: a row naming it computes the base model)."""
        self._write_slot(slot, None)

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        if self.lora is None:
            raise ValueError("this runner has no LoRA slots (enable_lora is off)")
        if not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot must be an integer in [0, {self.max_loras}), got {slot!r}")
        self.lora = self._write_lora(self.lora, np.int32(slot), self.slot_arrays.get(adapter))

    def lora_compiled(self) -> int:
        """Programs compiled so far to fill LoRA slots (at most one)."""
        return 0 if self.lora is None else self._write_lora._cache_size()

    @property
    def splits_sampling(self) -> bool:
        """Whether `dispatch(masks_later=True)` splits a step (one device, one process; elsewhere it never does)."""
        one_process = self.leader is None or self.leader.channel is None
        return (self.mesh is None or self.mesh.devices.size == 1) and one_process

    def dispatch(self, rows: list[Row], table_width: int | None = None, *,
                 masks_later: bool = False) -> StepHandle:
        """Starts a step over `rows` without waiting for it; returns the handle `fetch` reads it back with.
        table_width: the page table's (a bucket; default: the narrowest that spans every row's tokens, this step's
        new ones included, as the penalties' past tokens must). masks_later (where `splits_sampling`): the forward
        alone; the rows sample once `join_masks` brings their masks."""
        self._check_lora_slots(rows)
        tokens = round_up(sum(len(r.token_ids) for r in rows), self.buckets.num_tokens)
        scored = self.num_speculative_tokens + 1 if any(r.num_draft for r in rows) else 1
        if table_width is None:
            table_width = self.buckets.table_width(max(pages_needed(r.end, self.page_size) for r in rows))
        split = masks_later and self.splits_sampling
        if split and scored > 1:  # the engine reads a speculative step's last step back first: nothing to split
            raise ValueError("a split step verifies no proposals")
        rows = self.penalties.place(rows, split)
        batch = build_batch(rows, self.page_size, self.config.vocab_size, tokens, self.buckets.num_rows(tokens),
                            table_width, scored, sample_rows=not split)
        if split:
            # The same forward program as a whole step's, its rows' head and sampling skipped (`sample_joined`).
            return StepHandle(len(rows), None, (self.run(batch), rows, batch.sampling.token_mask.shape))
        if self.leader is None:
            out = self.run(batch)
        else:  # a multi-process leader: every process runs the same step
            out = self.leader.lead_step(self.index, batch, self.run)
        assert isinstance(out, StepOutput)  # a whole step's
        return StepHandle(len(rows), _trimmed(out, rows))

    def join_masks(self, handle: StepHandle, masks: np.ndarray | None) -> None:
        """Samples the rows of a step dispatched with masks_later, each under its masks [rows, ceil(V / 32)] int32
        as well as its own (-1 words: no more than its own; None: every row under its own); without waiting. A
        step dispatched whole (this runner does not split) takes none: it is never dispatched so with such rows."""
        if handle.forward is None:
            return
        split, rows, shape = handle.forward
        joined = np.full(shape, -1, np.int32)  # [S, W]: the padding rows allow everything
        if masks is not None:
            joined[:len(masks)] = masks
        out, self.last_tokens = self.steps.sample_joined(self.params, split, self.last_tokens, joined)
        handle.output, handle.forward = _trimmed(out, rows), None

    def _check_lora_slots(self, rows: list[Row]) -> None:
        for i, r in enumerate(rows):
            if r.lora_slot != -1 and not 0 <= r.lora_slot < self.max_loras:  # a gather would clamp it silently
                raise ValueError(f"row {i}: LoRA slot {r.lora_slot} is not one of this runner's "
                                 f"{self.max_loras} (enable_lora {'on' if self.lora is not None else 'off'})")

    def run(self, batch: StepInput) -> StepOutput | SplitForward:
        """The device side of a step whose batch is built (all a multi-process follower does of it). A step with no
        token on an adapter runs the base model's program (no LoRA term at all), one with any runs the LoRA program:
        warm-up compiles both. A batch with sample_rows False gives the first half of a split step."""
        counts = self.penalties.counts()
        out, self.kv_cache, self.last_tokens, self.features, counts = self.steps.step_with_features(
            self.params, self.kv_cache, self.last_tokens, self.features, batch, self.step_lora(batch), penalties=counts)
        if counts is not None:
            self.penalties.state = counts
        return out

    def step_lora(self, batch: StepInput):
        """The adapters' buffers if any token of the batch is on one (lora_slot [T] >= 0), else None: no LoRA term."""
        return self.lora if self.lora is not None and bool(np.any(np.asarray(batch.lora_slot) >= 0)) else None

    def wait(self, handle: StepHandle, until: float | None = None) -> bool:
        if until is None:
            jax.block_until_ready(handle.output)
            return True
        leaves = jax.tree.leaves(handle.output)
        # Naps of a millisecond at most: no wake-up to wait on with a deadline, and little host time taken from a
        # device that shares the cores.
        while not (ran := all(x.is_ready() for x in leaves)) and (left := until - time.perf_counter()) > 0:
            time.sleep(min(left, 1e-3))
        return ran

    def fetch(self, handle: StepHandle) -> StepOutput:
        """Waits for a dispatched step and copies what it sampled to the host in one transfer, cut to its rows."""
        # Whole arrays, cut on the host: slicing a device array would compile a small program for every new
        # (bucket, rows) pair while serving.
        got = jax.device_get(handle.output)
        per_row = jax.tree.map(lambda x: x[:handle.num_rows], dataclasses.replace(got, prompt=None))
        return dataclasses.replace(per_row, prompt=got.prompt)  # per scored token, not per row

    def warmup(self, progress: bool = True, time_steps: bool = False) -> int:
        """Compiles every program a step may run before serving (`jaxserve.runner.warmup`); returns how many.
        time_steps: also time each shape once compiled (into step_times)."""
        return warm_up(self, progress, time_steps)
