"""Transfers waiting to be fetched: KV pages held by transfer id until a decode server takes them (once) or their
time runs out, so a transfer nobody claims (the decode server died, the router gave up) frees its memory.

The prefill engine's thread puts; the event loop serving fetches takes; so every method holds a lock.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

from jaxserve.kv_transfer.errors import KVTransferError
from jaxserve.kv_transfer.layout import flatten_pages

REMEMBERED_EXPIRED = 4096  # ids remembered after they expire, so a late fetch hears "expired", not "unknown"


class KVStoreFull(Exception):
    """A put that would hold more than the store's max_bytes: the transfers waiting are fetched (or expire) first."""


@dataclasses.dataclass
class _Entry:
    kv: list  # KVPages
    nbytes: int
    deadline: float


class KVStore:
    """KV pages by transfer id (a string, unique per transfer: the request id serves), each taken at most once and
    dropped `ttl_s` seconds after it was put if not taken. max_bytes (None: no bound) caps what it holds at once:
    transfers nobody claims must not fill the host's memory within a TTL."""

    def __init__(self, ttl_s: float = 60.0, clock=time.monotonic, max_bytes: int | None = None):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_bytes is not None and not max_bytes > 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._expired_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._bytes_held = 0
        self.expired = 0  # transfers dropped unclaimed, since the start
        self.taken = 0

    def put(self, transfer_id: str, kv) -> int:
        """Holds kv (KVPages: numpy arrays, or jax arrays for a device-to-device pull) under transfer_id; returns
        its bytes. A ValueError if the id is held already (two transfers must not share an id); KVStoreFull if it would
        hold more than max_bytes."""
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError(f"a transfer id is a non-empty string, got {transfer_id!r}")
        nbytes = sum(int(a.nbytes) for a in flatten_pages(kv)[1])
        with self._lock:
            self._expire_locked()
            if transfer_id in self._entries:
                raise ValueError(f"transfer {transfer_id!r} is held already")
            if self.max_bytes is not None and self._bytes_held + nbytes > self.max_bytes:
                raise KVStoreFull(f"the KV transfers waiting to be fetched hold {self._bytes_held} bytes: "
                                  f"{nbytes} more would pass the bound of {self.max_bytes}")
            self._entries[transfer_id] = _Entry(kv, nbytes, self._clock() + self.ttl_s)
            self._expired_ids.pop(transfer_id, None)
            self._bytes_held += nbytes
        return nbytes

    def take(self, transfer_id: str) -> list:
        """The pages put under transfer_id, removed from the store; KVTransferError if it was never put, was taken
        already or has expired."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.pop(transfer_id, None)
            if entry is None:
                state = "expired (unclaimed for its TTL)" if transfer_id in self._expired_ids else "unknown or taken"
                raise KVTransferError(f"KV transfer {transfer_id!r} is {state}")
            self._bytes_held -= entry.nbytes
            self.taken += 1
            return entry.kv

    def discard(self, transfer_id: str) -> bool:
        """Drops a transfer that will not be fetched (its request was aborted); whether it was held."""
        with self._lock:
            entry = self._entries.pop(transfer_id, None)
            if entry is not None:
                self._bytes_held -= entry.nbytes
            return entry is not None

    def expire(self) -> int:
        """Drops the transfers whose TTL has passed (every call does; the server calls this on a timer so memory
        frees with no traffic); how many it dropped."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = self._clock()
        gone = []
        for tid, e in self._entries.items():  # in order of put, so of deadline (one TTL): stop at the first alive
            if e.deadline > now:
                break
            gone.append(tid)
        for tid in gone:
            self._bytes_held -= self._entries.pop(tid).nbytes
            self._expired_ids[tid] = None
        while len(self._expired_ids) > REMEMBERED_EXPIRED:
            self._expired_ids.popitem(last=False)
        self.expired += len(gone)
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._entries)

    def full(self) -> bool:
        """Whether it holds max_bytes already (no put can succeed)."""
        return self.max_bytes is not None and self.bytes_held >= self.max_bytes

    @property
    def bytes_held(self) -> int:
        with self._lock:
            self._expire_locked()
            return self._bytes_held
