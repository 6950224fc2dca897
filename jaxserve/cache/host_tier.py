"""A host-memory tier under the prefix cache (vLLM's KV offloading, `kv_offloading_size`): full pages the device
cache evicts are copied to host memory, and a later prompt that finds its prefix here has those pages copied back
into fresh device pages instead of computing them again.

Entries are keyed as the prefix cache keys its pages (a chained SHA-256 of the prefix, see
`jaxserve.cache.prefix_cache`) and carry the same (parent key, key, tokens) content, which a hit compares in full.
They wait in an LRU under a byte budget: storing past it forgets the least recently used ones.

A store arrives as an export the runner has dispatched and not finished (`KVPages` padded to a page-count bucket, see
`jaxserve.cache.transfer`): its arrays are moved to the `pinned_host` memory kind where the backend has one (a
device-to-host copy started, not waited for) and become per-page numpy copies once they have landed (`settle`,
polled once per engine step, which never blocks), so a store never makes the host wait for the device. Loading reads
numpy pages (the rare load of a page still landing waits for its copy). Pages are exported as their values (a bf16
cache stored as bits exports bf16; an int8 cache its values and scales), so a round trip is bit-exact.

One writer: the engine's side (`jaxserve.batching.host_swap.HostSwap`) stores, loads, settles and sets the rates;
the scheduler only asks what is here (`holds`) and whether loading beats computing (`worth_loading`).
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

import jax
import numpy as np

from jaxserve.cache.kv_cache import check_kv_cache_dtype
from jaxserve.cache.transfer import KVPages, is_ready, kv_bytes, trimmed

Content = tuple  # (parent key, key, tokens): what the prefix cache remembers of a page, compared in full on a hit
GIB = 1 << 30


@dataclasses.dataclass
class _Block:
    """One store's pages: jax arrays on their way to host memory, then numpy."""
    kv: KVPages
    started: float  # time.perf_counter() of the store
    num_pages: int  # pages stored (its padding excluded)
    num_bytes: int  # their bytes
    landed: bool = False


@dataclasses.dataclass
class _Entry:
    content: Content
    block: _Block
    index: int  # the page's place in its block
    num_bytes: int


def check_kv_options(c) -> None:
    """An EngineConfig's KV-cache options: its kv_cache_dtype, and a kv_offloading_size (GiB, vLLM's) that is off
    (None or 0) or a positive number, with what the tier needs: the prefix cache (its keys and its evictions), no
    draft model (its pages beside the target's are not moved) and no disaggregated prefill (its own transfers)."""
    check_kv_cache_dtype(c.kv_cache_dtype)
    size = c.kv_offloading_size
    if size is None or size == 0:
        return
    if not isinstance(size, (int, float)) or isinstance(size, bool) or not size > 0 or size != size:
        raise ValueError(f"kv_offloading_size must be a number of GiB >= 0 (0 or None: off), got {size!r}")
    if not c.enable_prefix_caching:
        raise ValueError("kv_offloading_size keeps the pages the prefix cache evicts: it needs enable_prefix_caching")
    if c.speculative_config is not None and c.speculative_config.method == "draft_model":
        raise ValueError("kv_offloading_size is not supported with a draft model yet (its KV pages are not moved)")
    if c.prefill_replicas or c.role != "both":
        raise ValueError("kv_offloading_size is not supported with disaggregated prefill yet")


def to_host_memory(kv: KVPages) -> KVPages:
    """kv's arrays copied (started, not waited for) to their devices' pinned host memory, where the backend has
    that memory kind; numpy arrays, and arrays on a backend without it, as they are."""
    def move(x):
        sharding = getattr(x, "sharding", None)
        if sharding is None or sharding.memory_kind == "pinned_host":
            return x
        device = next(iter(sharding.device_set))
        if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
            return x
        return jax.device_put(x, sharding.with_memory_kind("pinned_host"))
    return jax.tree.map(move, kv)


class HostTier:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"a host KV tier needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._landing: list[_Block] = []
        # Pages and bytes moved each way, and their seconds from dispatch to landing (polled once per step).
        self.stored_pages = self.stored_bytes = self.loaded_pages = self.loaded_bytes = 0
        self.store_seconds = self.load_seconds = 0.0
        self._loading: list[tuple[KVPages, float]] = []  # loads dispatched to the device, not yet landed
        # What a load and a recompute cost (None: not measured; then loading is taken to win).
        self.bytes_per_s: float | None = None
        self.tokens_per_s: float | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: bytes, content: Content) -> bool:
        """The page under `key` is here with this content (no LRU touch: the scheduler asks, the loader touches)."""
        entry = self._entries.get(key)
        return entry is not None and entry.content == content

    def worth_loading(self, num_pages: int, page_size: int) -> bool:
        """Loading num_pages beats computing their tokens again: bytes over the measured transfer rate against
        tokens over the measured prefill rate (recomputing 100K tokens is minutes; moving their pages, seconds)."""
        if not num_pages or self.bytes_per_s is None or self.tokens_per_s is None or not self._entries:
            return True
        per_page = self.num_bytes / len(self._entries)
        return num_pages * per_page / self.bytes_per_s <= num_pages * page_size / self.tokens_per_s

    def store(self, contents: list[Content], kv: KVPages) -> None:
        """Keeps kv's first len(contents) pages (an export, perhaps padded and still in flight) under their
        contents' keys, forgetting least recently used pages past the budget."""
        n = len(contents)
        if not n:
            return
        per_page = kv_bytes(kv) // jax.tree.leaves(kv)[0].shape[0]
        block = _Block(to_host_memory(kv), time.perf_counter(), n, n * per_page)
        self._landing.append(block)
        for i, content in enumerate(contents):
            key = content[1]
            if key in self._entries:
                self._forget(key)
            if per_page > self.capacity_bytes:
                continue
            while self.num_bytes + per_page > self.capacity_bytes:
                self._forget(next(iter(self._entries)))
            self._entries[key] = _Entry(content, block, i, per_page)
            self.num_bytes += per_page
        self.stored_pages += n
        self.stored_bytes += block.num_bytes

    def load(self, keys: list[bytes]) -> KVPages:
        """The pages under keys (each held: see `holds`), as numpy [len(keys), ...] per array; they become the most
        recently used."""
        entries = [self._entries[k] for k in keys]
        for k in keys:
            self._entries.move_to_end(k)
        for block in {id(e.block): e.block for e in entries}.values():
            self._land(block)
        kv = jax.tree.map(lambda *xs: np.stack(xs), *[jax.tree.map(lambda x, i=e.index: x[i], e.block.kv)
                                                      for e in entries])
        self.loaded_pages += len(keys)
        self.loaded_bytes += sum(e.num_bytes for e in entries)
        return kv

    def loading(self, kv: KVPages) -> None:
        """A load's copy to the device was dispatched now: its seconds count once it has landed (`settle`)."""
        self._loading.append((kv, time.perf_counter()))

    def settle(self, wait: bool = False) -> None:
        """Stores whose copies have landed become numpy, and landed loads count their seconds; waits for none
        (wait: for every one)."""
        if wait:
            jax.block_until_ready([b.kv for b in self._landing] + [kv for kv, _ in self._loading])
        now = time.perf_counter()
        for block in [b for b in self._landing if is_ready(b.kv)]:
            self._land(block, now)
        still = []
        for kv, started in self._loading:
            if is_ready(kv):
                self.load_seconds += now - started
            else:
                still.append((kv, started))
        self._loading = still

    def clear(self) -> None:
        """Forgets every page (a prefix-cache reset)."""
        self._entries.clear()
        self.num_bytes = 0

    def _land(self, block: _Block, now: float | None = None) -> None:
        if block.landed:
            return
        block.kv = trimmed(block.kv, block.num_pages)  # its padding dropped; waits, if it has not landed
        block.landed = True
        self._landing.remove(block)
        self.store_seconds += (time.perf_counter() if now is None else now) - block.started

    def _forget(self, key: bytes) -> None:
        self.num_bytes -= self._entries.pop(key).num_bytes
