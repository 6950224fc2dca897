"""Where each adapter is: on the host (`HostAdapters`: up to max_cpu_loras loaded, least recently used forgotten
first, shared by every replica) and on a runner's device (`LoRASlots`: max_loras slots, filled least recently used
first, never one a running sequence uses).

An adapter is named by its `lora_int_id` (vLLM's API: add, remove and list by id), and its content by a digest
(`LoadedAdapter.key`): what a slot holds and what the prefix cache keys its pages under, so two ids of the same
weights share, and an id removed and re-added with other weights never meets the first one's KV.
A sequence holds its LoadedAdapter from the moment it is made until it ends: an adapter the host forgets while a
request waits is never read from disk again for it, and nothing can fail to load after a request was accepted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from jaxserve.lora.adapter import LoRAAdapter
    from jaxserve.lora.request import LoRARequest


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """An adapter's host arrays, the request that named it, and the digest of its content."""
    request: LoRARequest
    adapter: LoRAAdapter
    key: bytes  # sha256 of the adapter's weights (content_key)


def content_key(x) -> bytes:
    """A digest of everything x holds (arrays by dtype, shape and bytes, dataclasses and containers by their
    fields and items, anything else by repr)."""
    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, np.ndarray):
            h.update(f"array {x.dtype} {x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            h.update(type(x).__name__.encode())
            for f in dataclasses.fields(x):
                h.update(f"field {f.name}".encode())
                walk(getattr(x, f.name))
        elif isinstance(x, dict):
            h.update(b"dict")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"seq {len(x)}".encode())
            for v in x:
                walk(v)
        elif hasattr(x, "__array__") and not isinstance(x, (str, bytes)):  # a device array, if one ever comes
            walk(np.asarray(x))
        else:
            h.update(repr(x).encode())
    walk(x)
    return h.digest()


class HostAdapters:
    """Adapters loaded on the host, by lora_int_id: at most `capacity`, the least recently used forgotten first.
    Thread-safe (requests are checked, and adapters added, on other threads than the one stepping)."""

    def __init__(self, load: Callable[[LoRARequest], LoRAAdapter], capacity: int,
                 prepare: Callable[[LoRAAdapter], None] | None = None):
        """load(request): reads an adapter (raises LoRAError if it is bad). prepare(adapter): builds what the runners'
        slot writes read (their padded arrays: `jaxserve.lora.buffers.SlotArrays`), on the thread that gets the
        adapter, so that the engine thread does not."""
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {capacity}")
        self._load = load
        self._prepare = prepare
        self.capacity = capacity
        self._by_id: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        # One read at a time: an adapter's arrays (up to max_lora_rank x the model's shapes) are in memory once, and
        # loads that pile up wait here rather than each reading its own. Not _lock: a load holds up other loads only,
        # not the requests of adapters held, nor remove / list (which the server calls on its event loop).
        self._reading = threading.Lock()

    def get(self, request: LoRARequest) -> LoadedAdapter:
        """The request's adapter, loaded now if the host does not hold it. Raises LoRAError for a bad adapter, and
        ValueError for an id the host holds under another name or path (remove it first)."""
        with self._lock:
            held = self._held(request)
        if held is not None:
            self._prepared(held)  # built when it was loaded (at once), unless that failed
            return held
        with self._reading:
            with self._lock:  # read while this one waited?
                held = self._held(request)
            if held is not None:
                return held
            adapter = self._load(request)  # raises before anything changes
            loaded = LoadedAdapter(request, adapter, content_key(adapter.weights))
            self._prepared(loaded)
            with self._lock:
                self._by_id[request.lora_int_id] = loaded
                while len(self._by_id) > self.capacity:
                    self._by_id.popitem(last=False)
                return loaded

    def _prepared(self, loaded: LoadedAdapter) -> None:
        if self._prepare is not None:
            self._prepare(loaded.adapter)

    def _held(self, request: LoRARequest) -> LoadedAdapter | None:
        """The adapter held under the request's id (now the most recently used), if any; under the lock."""
        held = self._by_id.get(request.lora_int_id)
        if held is not None:
            old = held.request
            if (old.lora_name, old.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {old.lora_name!r} "
                                 f"({old.lora_path}), not {request.lora_name!r} ({request.lora_path}): remove "
                                 "it first, or give the new adapter another id")
            self._by_id.move_to_end(request.lora_int_id)
        return held

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter; False if the host did not hold it. Requests already made with it still run."""
        with self._lock:
            return self._by_id.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        with self._lock:
            return set(self._by_id)

    def requests(self) -> list[LoRARequest]:
        """The adapters held, least recently used first."""
        with self._lock:
            return [a.request for a in self._by_id.values()]


class LoRASlots:
    """One runner's device slots. A running sequence with an adapter holds a slot (`take`) until it stops running
    (`release`): so the adapters of one step are never more than the slots, and a slot in use is never refilled.
    A released slot keeps its adapter, for the next request that names it, until a slot is needed for another."""

    def __init__(self, num_slots: int, load_into: Callable[[int, LoRAAdapter], None]):
        """load_into(slot, adapter): writes an adapter's arrays into a device slot (the runner's load_lora)."""
        if num_slots < 1:
            raise ValueError(f"max_loras must be at least 1, got {num_slots}")
        self._load_into = load_into
        self._held: list[bytes | None] = [None] * num_slots  # slot -> the key of the adapter it holds
        self._users = [0] * num_slots  # slot -> running sequences using it
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))  # least recently taken first
        self.num_loads = 0

    @property
    def num_slots(self) -> int:
        return len(self._held)

    def slot_of(self, lora: LoadedAdapter) -> int | None:
        try:
            return self._held.index(lora.key)
        except ValueError:
            return None

    def can_take(self, lora: LoadedAdapter) -> bool:
        """A slot holds the adapter already, or one is free to load it into."""
        return self.slot_of(lora) is not None or any(u == 0 for u in self._users)

    def take(self, lora: LoadedAdapter) -> int:
        """A slot holding the adapter, for one more running sequence: its own if loaded, else the least recently
        used slot nobody uses, loaded now. RuntimeError if every slot is in use (ask can_take first)."""
        slot = self.slot_of(lora)
        if slot is None:
            slot = next((s for s in self._lru if self._users[s] == 0), None)
            if slot is None:
                raise RuntimeError(f"all {self.num_slots} LoRA slots are in use")
            self._held[slot] = None  # if loading fails, the slot holds nothing known
            self._load_into(slot, lora.adapter)
            self._held[slot] = lora.key
            self.num_loads += 1
        self._users[slot] += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if self._users[slot] <= 0:
            raise ValueError(f"releasing LoRA slot {slot}, which no sequence holds")
        self._users[slot] -= 1

    def users(self, slot: int) -> int:
        return self._users[slot]

    def num_in_use(self) -> int:
        return sum(u > 0 for u in self._users)
