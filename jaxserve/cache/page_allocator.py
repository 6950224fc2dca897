"""Host-side page bookkeeping: a free list of KV-cache pages."""
from __future__ import annotations

from jaxserve.cache.kv_cache import SCRATCH_PAGE


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("need at least 2 pages (page 0 is the scratch page)")
        self.num_pages = num_pages
        # Popped from the end: low page ids go out first, which keeps small runs easy to read in a debugger.
        self._free = [p for p in range(num_pages - 1, -1, -1) if p != SCRATCH_PAGE]
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def usage(self) -> float:
        """Fraction of usable pages held by sequences."""
        return 1.0 - self.num_free / self.num_usable

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._held.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        if not self._held.issuperset(pages) or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages that are not held: {sorted(set(pages) - self._held)}")
        self._held.difference_update(pages)
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
