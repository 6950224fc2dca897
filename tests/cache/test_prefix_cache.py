"""The prefix cache under random admissions, publications and releases (property-based), and its eviction order."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache import OutOfPages, PageAllocator, PrefixCache, page_keys, pages_needed

PAGE = 4


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 30),
       ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=24)), max_size=40))
def test_refcounts_match_holders_and_no_page_is_lost(num_pages, ops):
    cache = PrefixCache(PageAllocator(num_pages), PAGE)
    held: list[tuple[list[int], list[int]]] = []  # (tokens, pages) per live sequence
    for admit, tokens in ops:
        if admit:
            keys = page_keys(tokens, PAGE, [])
            hit = cache.match(tokens, keys, (len(tokens) - 1) // PAGE)
            for i, p in enumerate(hit):  # a hit holds exactly the tokens asked for
                assert cache._content[p][2] == tuple(tokens[i * PAGE:(i + 1) * PAGE])
            need = pages_needed(len(tokens), PAGE) - len(hit)
            try:
                pages = hit + cache.allocate(need)
            except OutOfPages:
                assert need > cache.num_available
                cache.release(hit)
                continue
            cache.publish(pages, tokens, keys, 0)  # as if its prompt was now computed
            held.append((tokens, pages))
        elif held:
            cache.release(held.pop(len(tokens) % len(held))[1])
        holders: dict[int, int] = {}
        for _, pages in held:
            assert len(set(pages)) == len(pages)
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        for p in range(num_pages):
            assert cache.refcount(p) == holders.get(p, 0)
        assert 0 not in holders  # the scratch page is never handed out
        assert len(holders) + cache.num_available == cache.allocator.num_usable
    for _, pages in held:
        cache.release(pages)
    assert cache.num_available == cache.allocator.num_usable
    cache.reset()
    assert cache.allocator.num_free == cache.allocator.num_usable and cache.num_cached == 0


def test_least_recently_released_page_is_evicted_first():
    cache = PrefixCache(PageAllocator(4), PAGE)  # 3 usable pages
    a, b = [1] * PAGE + [9], [2] * PAGE + [9]
    pages_a, pages_b = cache.allocate(1), cache.allocate(1)
    cache.publish(pages_a, a, page_keys(a, PAGE, []), 0)
    cache.publish(pages_b, b, page_keys(b, PAGE, []), 0)
    cache.release(pages_a)
    cache.release(pages_b)
    assert cache.num_available == 3 and cache.num_cached == 2
    cache.allocate(2)  # one free page, then evicts a's (released first)
    assert cache.match(a, page_keys(a, PAGE, []), 1) == []
    assert cache.match(b, page_keys(b, PAGE, []), 1) == pages_b


def test_disabled_cache_never_hits():
    cache = PrefixCache(PageAllocator(8), PAGE, enabled=False)
    tokens = list(range(9))
    pages = cache.allocate(3)
    cache.publish(pages, tokens, page_keys(tokens, PAGE, []), 0)
    cache.release(pages)
    assert cache.match(tokens, page_keys(tokens, PAGE, []), 2) == []
    assert cache.num_available == 7


def test_keys_chain_sha256_over_the_whole_prefix():
    import hashlib

    import numpy as np
    tokens = list(range(100, 112))
    keys = page_keys(tokens, PAGE, [])
    assert len(keys) == 3
    parent = b""
    for i, key in enumerate(keys):
        assert key == hashlib.sha256(parent + np.asarray(tokens[i * PAGE:(i + 1) * PAGE], "<i4").tobytes()).digest()
        parent = key
    other = page_keys([0] + tokens[1:], PAGE, [])
    assert all(a != b for a, b in zip(keys, other))  # a different first page changes every key after it


def test_a_colliding_key_never_splices_another_prefix():
    """As if prompt b's second page key collided with prompt a's (same tokens, different first page): the hit stops
    at b's own first page and never serves a's second page, whose KV was computed after a's first."""
    cache = PrefixCache(PageAllocator(8), PAGE)
    a, b = [1] * 4 + [7] * 4 + [9], [2] * 4 + [7] * 4 + [9]
    pages_a = cache.allocate(3)
    cache.publish(pages_a, a, page_keys(a, PAGE, []), 0)
    cache.release(pages_a)
    pages_b = cache.allocate(1)
    cache.publish(pages_b, b, page_keys(b[:4], PAGE, []), 0)
    cache.release(pages_b)
    colliding = page_keys(b, PAGE, [])[:1] + page_keys(a, PAGE, [])[1:2]
    assert cache.match(b, colliding, 2) == pages_b
