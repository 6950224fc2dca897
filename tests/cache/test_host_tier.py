"""The host KV tier: an LRU of pages under a byte budget, and pages that come back from host memory bit-exact."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.host_tier import HostTier, to_host_memory
from jaxserve.cache.kv_cache import init_kv_cache, write_pages
from jaxserve.cache.prefix_cache import ROOT_KEY
from jaxserve.cache.transfer import gather_pages, scatter_pages
from jaxserve.config import ModelConfig

PAGE = 4 * 8 * 4  # one page below: 4 tokens x 8 values, float32


def content(i: int) -> tuple:
    return (ROOT_KEY, bytes([i]), (i,) * 4)


def pages(values: list[int]):
    """KVPages of len(values) pages, one layer: each page full of its value (K), and its negation (V)."""
    k = np.stack([np.full((4, 8), v, np.float32) for v in values])
    return [(k, -k)]


def test_least_recently_used_pages_go_first_under_the_byte_budget():
    tier = HostTier(3 * 2 * PAGE)  # 3 pages (K and V each)
    tier.store([content(i) for i in range(3)], pages([0, 1, 2]))
    tier.load([bytes([0])])  # page 0 is now the most recently used
    tier.store([content(3)], pages([3]))
    assert [tier.holds(bytes([i]), content(i)) for i in range(4)] == [True, False, True, True]
    assert tier.num_bytes == 3 * 2 * PAGE and len(tier) == 3
    (k, v), = tier.load([bytes([3]), bytes([0])])
    np.testing.assert_array_equal(k[:, 0, 0], [3, 0])
    np.testing.assert_array_equal(v, -k)
    assert (tier.stored_pages, tier.loaded_pages, tier.loaded_bytes) == (4, 3, 3 * 2 * PAGE)


def test_a_hit_needs_the_whole_content_and_padding_is_not_kept():
    tier = HostTier(10 * 2 * PAGE)
    tier.store([content(1)], pages([1, 0, 0, 0]))  # an export padded to 4 pages holds one
    assert tier.num_bytes == 2 * PAGE and len(tier) == 1
    assert not tier.holds(bytes([1]), (ROOT_KEY, bytes([1]), (9,) * 4))  # same key, other tokens
    assert not tier.holds(bytes([1]), (b"other parent", bytes([1]), (1,) * 4))
    tier.settle()
    assert jax.tree.leaves(tier.load([bytes([1])]))[0].shape == (1, 4, 8)
    tier.store([content(1)], pages([7]))  # stored again: replaced, not counted twice
    assert tier.num_bytes == 2 * PAGE and tier.load([bytes([1])])[0][0][0, 0, 0] == 7
    small = HostTier(PAGE)  # smaller than one page: keeps nothing
    small.store([content(1)], pages([1]))
    assert len(small) == 0 and small.num_bytes == 0
    with pytest.raises(ValueError, match="positive"):
        HostTier(0)


def test_loading_is_chosen_only_where_it_beats_recomputing():
    tier = HostTier(10 * 2 * PAGE)
    tier.store([content(1)], pages([1]))
    assert tier.worth_loading(5, 4)  # not measured: load
    tier.bytes_per_s, tier.tokens_per_s = 2 * PAGE * 100.0, 4 * 10.0  # a page: 10 ms to load, 100 ms to compute
    assert tier.worth_loading(5, 4)
    tier.tokens_per_s = 4 * 1000.0  # now 1 ms to compute
    assert not tier.worth_loading(5, 4)


def test_exports_move_to_pinned_host_memory():
    x = jnp.arange(8.0)
    moved, _ = jax.tree.leaves(to_host_memory([(x, x)]))
    kinds = {m.kind for m in x.devices().pop().addressable_memories()}
    assert moved.sharding.memory_kind == ("pinned_host" if "pinned_host" in kinds else x.sharding.memory_kind)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(x))


@pytest.mark.parametrize("dtype,kv_cache_dtype,bits", [(jnp.float32, "auto", False), (jnp.bfloat16, "auto", True),
                                                       (jnp.float32, "int8", False)],
                         ids=["float32", "bf16-bits", "int8"])
def test_pages_come_back_from_the_host_bit_exact(dtype, kv_cache_dtype, bits):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    config = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=2,
                         num_heads=2, num_kv_heads=2, head_dim=16)
    cache = init_kv_cache(config, 12, 4, dtype, kv_cache_dtype, bf16_as_bits=bits)
    slots = jnp.arange(4, 4 + 5 * 4)  # pages 1-5
    cache = [tuple(write_pages(p, jnp.asarray(rng.normal(size=(20, 2, 16)), dtype), slots) for p in layer)
             for layer in cache]
    tier = HostTier(1 << 30)
    exported = jax.jit(gather_pages)(cache, jnp.array([2, 3, 5, 0], jnp.int32))  # padded with the scratch page
    tier.store([content(i) for i in range(3)], exported)
    kv = tier.load([bytes([i]) for i in range(3)])
    assert all(isinstance(x, np.ndarray) and x.shape[0] == 3 for x in jax.tree.leaves(kv))
    back = jax.jit(scatter_pages)(cache, jnp.array([7, 8, 9], jnp.int32), kv)
    for was, now in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(was)[[2, 3, 5]], np.asarray(now)[[7, 8, 9]]), f"seed {seed}"
    assert tier.store_seconds > 0  # landed when loaded
