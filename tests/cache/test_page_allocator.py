"""The page allocator under random sequences of allocations and frees (property-based)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache import SCRATCH_PAGE, OutOfPages, PageAllocator


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_pages_are_never_shared_or_lost(num_pages, ops):
    alloc = PageAllocator(num_pages)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > alloc.num_free:
                with pytest.raises(OutOfPages):
                    alloc.allocate(n)
                continue
            held.append(alloc.allocate(n))
        elif held:
            alloc.free(held.pop(n % len(held)))
        flat = [p for pages in held for p in pages]
        assert len(flat) == len(set(flat)), "a page is held twice"
        assert SCRATCH_PAGE not in flat
        assert all(0 <= p < num_pages for p in flat)
        assert alloc.num_free + len(flat) == alloc.num_usable
        assert 0.0 <= alloc.usage() <= 1.0
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable and alloc.usage() == 0.0


def test_double_free_is_refused():
    alloc = PageAllocator(8)
    pages = alloc.allocate(3)
    alloc.free(pages)
    with pytest.raises(ValueError):
        alloc.free(pages)
    assert alloc.num_free == alloc.num_usable
