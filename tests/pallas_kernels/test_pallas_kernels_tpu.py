"""The ragged TPU attention kernel (Pallas Mosaic) under the TPU interpreter on CPU against the oracle, on fresh
random ragged batches: decode-only, prefill-only and mixed steps, rows crossing pages and blocks, GQA ratios 1 / 3
/ 4, a sliding window, int8 pages. Tiny shapes (the interpreter runs DMAs and semaphores one by one). Then lowering
for a TPU with no TPU here (jax.export), and the real Mosaic compiler where libtpu is installed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages
from jaxserve.pallas_kernels.ragged_attention_tpu import ragged_attention_tpu
from jaxserve.pallas_kernels.reference import ragged_attention_reference
from jaxserve.pallas_kernels.self_check import quantize_pages

from ragged import KINDS, expected, random_ragged_case, row_lengths

# Uninitialised VMEM reads as NaN, so a value the kernel never wrote shows in the output.
NAN_MEMORY = pltpu.InterpretParams(uninitialized_memory="nan")
TOL = dict(atol=2e-5, rtol=2e-5)


def fresh_rng():
    """New inputs every run; the seed goes into failure messages so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def run(case, *, k_pages=None, v_pages=None, window=None, block_q=4, pages_per_block=2, **options):
    rows = jax.tree.map(jnp.asarray, case.rows)
    k_pages = jnp.asarray(case.k_pages) if k_pages is None else k_pages
    v_pages = jnp.asarray(case.v_pages) if v_pages is None else v_pages
    args = (jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v), k_pages, v_pages, rows)
    got = ragged_attention_tpu(*args, sliding_window=window, block_q=block_q, pages_per_block=pages_per_block,
                               interpret=NAN_MEMORY, **options)
    return np.asarray(got), args


def check(got, want, seed):
    assert not np.isnan(got).any(), f"NaN in the output (a value never written, or a bad mask); seed {seed}"
    np.testing.assert_allclose(got, want, err_msg=f"seed {seed}", **TOL)


@pytest.mark.parametrize("kind,heads,kv_heads,window", [
    *zip(KINDS, (6, 4, 6), (2, 1, 2), (None,) * 3),  # decode, prefill, mixed; GQA 3 and 4
    ("mixed", 2, 2, 7),  # no GQA; a window shorter than a block of pages and than a row's new tokens
])
def test_matches_the_oracle(kind, heads, kv_heads, window):
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, kind, max_start=40), page_size=4, heads=heads,
                              kv_heads=kv_heads, head_dim=8)
    got, _ = run(case, window=window)
    check(got, expected(case, window), seed)


@pytest.mark.parametrize("window", [None, 9])
def test_page_table_read_in_chunks(window):
    """The table stays in HBM and a program DMAs only the chunks of its row's entries it walks into SMEM (at 128K
    the whole table, [64, 8192] int32, is twice v5e's SMEM): 3 entries a chunk over rows of up to 13 pages, the
    table padded to whole chunks, a window that starts the walk past the first chunks. An entry the walk reads
    but no DMA brought would name a page at random (uninitialised SMEM)."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=40), page_size=4, heads=4, kv_heads=2,
                              head_dim=8)
    assert case.rows.page_table.shape[1] > 3
    got, _ = run(case, window=window, pages_per_block=2, table_chunk=3)
    check(got, expected(case, window), seed)


def test_gemma3_head_shapes():
    """Gemma 3 270M's heads (4 query heads on 1 KV head of 256) in a sliding layer."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=24), page_size=4, heads=4, kv_heads=1,
                              head_dim=256)
    got, _ = run(case, window=9)
    check(got, expected(case, 9), seed)


def test_int8_pages_match_the_oracle_on_the_same_pages():
    """Dequantized in VMEM exactly as read_pages does: compared with the oracle reading the same int8 pages."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=40), page_size=4, head_dim=8)

    k_pages, v_pages = quantize_pages(jnp.asarray(case.k_pages)), quantize_pages(jnp.asarray(case.v_pages))
    got, args = run(case, k_pages=k_pages, v_pages=v_pages, window=30, block_q=8, pages_per_block=3)
    check(got, np.asarray(ragged_attention_reference(*args, sliding_window=30)), seed)


def lowering_calls(heads, kv_heads, head_dim, sds):
    """(function, argument shapes): a 512-token step of 64 rows over 8k-token page tables, float and int8 pages,
    with and without a window."""
    i32, bf16 = jnp.int32, jnp.bfloat16
    T, S, P, num_pages, page_size = 512, 64, 512, 1024, 16
    rows = RaggedRows(sds((T,), i32), sds((T,), i32), sds((S + 1,), i32), sds((S,), i32), sds((S, P), i32))
    pages = sds((num_pages, kv_heads, page_size, head_dim), bf16)
    int8_pages = Int8Pages(sds(pages.shape, jnp.int8), sds(pages.shape[:-1], jnp.float32))
    q, kv = sds((T, heads, head_dim), bf16), sds((T, kv_heads, head_dim), bf16)
    for cache in (pages, int8_pages):
        for window in (None, 512):
            def fn(q, k, v, k_pages, v_pages, rows, window=window):
                return ragged_attention_tpu(q, k, v, k_pages, v_pages, rows, sliding_window=window, block_q=32)
            yield fn, (q, kv, kv, cache, cache, rows)


@pytest.fixture
def v5e(monkeypatch):
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")  # Mosaic asks which chip it targets
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])  # a serving size; SmolLM2
def test_lowers_for_tpu(v5e, heads, kv_heads, head_dim):
    """Pallas' Mosaic lowering runs here without a TPU: it checks block shapes, DMAs and ops."""
    for fn, args in lowering_calls(heads, kv_heads, head_dim, jax.ShapeDtypeStruct):
        lowered = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        assert "tpu_custom_call" in lowered.mlir_module()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_compiles_for_tpu(v5e, heads, kv_heads, head_dim):
    """The real Mosaic compiler (tile alignment of every DMA and load), deviceless: needs libtpu installed
    (`pip install libtpu==0.0.42.*` next to jax 0.10.2; no TPU needed)."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    for fn, args in lowering_calls(heads, kv_heads, head_dim, sds):
        jax.jit(fn).lower(*args).compile()


def test_block_sizes_follow_the_pages_and_the_chips_vmem():
    """`tpu_blocks`: decode-only steps pack 8 / gcd(G, 8) tokens a program (whole 8-row tiles); a key block is the
    fewest pages that move 1 MiB of K and V, at most 16 (Llama 3 8B's 64 KB pages: 16; Gemma 3 1B's 16 KB: 16), at
    most the row's pages; a chip with less VMEM gets smaller blocks; the limit asked covers the modelled VMEM."""
    from jaxserve.pallas_kernels.tpu_blocks import MAX_PAGES_PER_BLOCK, TPU_VMEM, tpu_blocks, vmem_bytes
    assert [tpu_blocks(64, 64, 512, g, 1, 128, 16, 2, 2, False).block_q for g in (1, 2, 3, 4, 5, 8, 16)] == \
        [8, 4, 8, 2, 8, 1, 1]
    assert tpu_blocks(512, 64, 512, 4, 8, 128, 16, 2, 2, False).block_q == 16  # prefill: the block_q given
    llama = tpu_blocks(512, 64, 512, 4, 8, 128, 16, 2, 2, False)
    assert llama.pages_per_block == MAX_PAGES_PER_BLOCK
    assert tpu_blocks(8, 8, 512, 4, 8, 128, 128, 2, 2, False).pages_per_block == 2  # 128-token pages: 512 KB each
    assert tpu_blocks(8, 8, 4, 4, 8, 128, 16, 2, 2, False).pages_per_block == 4  # short page tables
    need = vmem_bytes(16, llama.pages_per_block, 4, 8, 128, 16, 2, 2, False)
    assert need < llama.vmem_limit_bytes <= TPU_VMEM
    small = tpu_blocks(512, 64, 512, 4, 8, 128, 16, 2, 2, False, vmem=8 << 20)
    assert small.pages_per_block < llama.pages_per_block and small.vmem_limit_bytes <= 8 << 20
