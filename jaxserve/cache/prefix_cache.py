"""Reference-counted pages, and full pages remembered by content so a later request can reuse them.

A full page is keyed by a chained SHA-256: over the key of the page before it and its tokens, so one key names a
whole prefix. The hash is cryptographic because the keys come from users' prompts: with a weak hash (Python's
`hash()`) a crafted prompt could collide with another user's prefix and be served that user's KV (the class of vLLM's
CVE-2025-25183). A hit also checks the page's tokens and its parent key, so even a collision could not splice one
prefix's page onto another. A page whose last holder lets go keeps its key and waits in an LRU; it is evicted
(forgotten, returned to the free list) only when a fresh page is needed and none is free. Only full pages are shared,
and a sequence only ever writes past the pages it matched, so a shared page is never written again.

With a host tier (`jaxserve.cache.host_tier`), an evicted page is listed to be stored there (`take_stores`: the
scheduler's plan carries them, the engine exports them before the step that reuses the page), and a lookup goes on
past the device's pages into the tier's (`match_host`): those pages are loaded into fresh ones before the step.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol

import numpy as np

from jaxserve.cache.host_tier import HostTier
from jaxserve.cache.page_allocator import OutOfPages, PageAllocator

ROOT_KEY = b""  # the parent of a sequence's first page


class TokenSlices(Protocol):
    """Token ids as this module reads them, by length and slices: a list, or a view that joins a sequence's prompt
    and output without copying them each step."""

    def __len__(self) -> int: ...

    def __getitem__(self, s: slice, /) -> list[int]: ...


def page_keys(token_ids: list[int], page_size: int, keys: list[bytes], salt: bytes = b"") -> list[bytes]:
    """Extends `keys` (the keys of the first len(keys) pages) to every full page of `token_ids`; returns it.

    salt: what else the pages' KV depends on (a LoRA adapter's content key; empty for the base model), hashed into
    the first page's key and so into every key after it: the same tokens under another salt share no page.
    """
    for i in range(len(keys), len(token_ids) // page_size):
        tokens = np.asarray(token_ids[i * page_size:(i + 1) * page_size], "<i4").tobytes()
        keys.append(hashlib.sha256((_parent(keys, i) if i else salt) + tokens).digest())
    return keys


def _parent(keys: list[bytes], i: int) -> bytes:
    """The key of page i's parent (the page before it)."""
    return keys[i - 1] if i else ROOT_KEY


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True, host: HostTier | None = None):
        """host: the host tier evicted pages go to (None: they are forgotten). Read here, written by the engine."""
        self.allocator = allocator
        self.host = host if enabled else None
        self._stores: list[tuple[int, tuple]] = []  # (page, content) evicted since take_stores, to store on the host
        self.page_size = page_size
        self.enabled = enabled
        self._refs: dict[int, int] = {}  # page -> holders (absent: free or evictable)
        self._by_key: dict[bytes, int] = {}  # key -> page
        # page -> (parent key, key, tokens): a hit compares all three
        self._content: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # pages nobody holds that keep a key, oldest first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached
        self.host_hits = 0  # of those, tokens found in the host tier

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out: free ones and evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a remembered prefix (held or evictable)."""
        return len(self._content)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise OutOfPages(f"asked for {n} pages, {self.num_available} available")
        while self.allocator.num_free < n:
            self._evict(next(iter(self._evictable)))
        pages = self.allocator.allocate(n)
        for p in pages:
            self._refs[p] = 1
        return pages

    def match(self, token_ids: TokenSlices, keys: list[bytes], max_pages: int) -> list[int]:
        """Holds and returns the cached pages of the longest cached prefix of `token_ids`, at most max_pages.

        `keys` are the token_ids' page keys (see page_keys).
        """
        pages = []
        if self.enabled:
            for i, key in enumerate(keys[:max_pages]):
                page = self._by_key.get(key)
                tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
                if page is None or self._content[page] != (_parent(keys, i), key, tokens):
                    break
                pages.append(page)
        for p in pages:
            self._evictable.pop(p, None)
            self._refs[p] = self._refs.get(p, 0) + 1
        return pages

    def num_cached_pages(self, token_ids: TokenSlices, keys: list[bytes]) -> int:
        """How many leading pages of token_ids `match` would find, holding nothing (a data-parallel router's
        question: which replica has this prompt's prefix)."""
        if not self.enabled:
            return 0
        for i, key in enumerate(keys):
            page = self._by_key.get(key)
            if page is None or self._content[page] != (_parent(keys, i), key,
                                                       tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])):
                return i
        return len(keys)

    def match_host(self, token_ids: TokenSlices, keys: list[bytes], start: int, max_pages: int) -> list[bytes]:
        """The keys of the pages from `start` on (the device's hit ends there) that the host tier holds, at most up
        to max_pages; holds nothing (the engine loads them, after the plan)."""
        found: list[bytes] = []
        if self.host is None:
            return found
        for i in range(start, min(max_pages, len(keys))):
            content = (_parent(keys, i), keys[i], tuple(token_ids[i * self.page_size:(i + 1) * self.page_size]))
            if not self.host.holds(keys[i], content):
                break
            found.append(keys[i])
        return found

    def take_stores(self) -> list[tuple[int, tuple]]:
        """The (page, content) evicted since the last call: the engine exports them to the host tier before any
        step that writes them again."""
        stores, self._stores = self._stores, []
        return stores

    def count_lookup(self, num_tokens: int, num_hit_tokens: int, num_host_tokens: int = 0) -> None:
        """Counts one admitted request's lookup in the hit rate (a lookup undone for lack of pages does not count);
        num_host_tokens of the hit came from the host tier."""
        self.queries += num_tokens
        self.hits += num_hit_tokens
        self.host_hits += num_host_tokens

    def publish(self, pages: list[int], token_ids: TokenSlices, keys: list[bytes], start: int) -> None:
        """Remembers pages[start:len(keys)], now full of token_ids, under their keys (a held page's content)."""
        if not self.enabled:
            return
        for i in range(start, len(keys)):
            page, key = pages[i], keys[i]
            if key in self._by_key or page in self._content:
                continue  # the same prefix computed twice at once: the first copy stays the cached one
            self._by_key[key] = page
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            self._content[page] = (_parent(keys, i), key, tokens)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            n = self._refs.get(p, 0)
            if n <= 0:
                raise ValueError(f"releasing page {p}, which nobody holds")
            if n > 1:
                self._refs[p] = n - 1
                continue
            del self._refs[p]
            if p in self._content:
                self._evictable[p] = None
            else:
                self.allocator.free([p])

    def reset(self) -> None:
        """Forgets every evictable page (held pages keep their keys until released)."""
        for p in list(self._evictable):
            self._evict(p, store=False)

    def _evict(self, page: int, store: bool = True) -> None:
        del self._evictable[page]
        content = self._content.pop(page)
        del self._by_key[content[1]]
        if store and self.host is not None:
            self._stores.append((page, content))
        self.allocator.free([page])
