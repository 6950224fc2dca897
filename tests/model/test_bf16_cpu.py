"""dtype="bfloat16" on CPU: the matmul through XLA:CPU's fast bf16 kernel (bf16 x bf16 accumulated into float32, at
least two rows: `jaxserve.model.quant.bf16_dot_matmul`), and the KV cache stored as bf16 bits (uint16), which XLA:CPU
writes in place and reads a block at a time."""
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import init_kv_cache, read_head_major, values_dtype, write_pages
from jaxserve.cache.transfer import gather_pages, scatter_pages
from jaxserve.cpu_kernels import few_row_matmul
from jaxserve.model.attention import ragged_attention
from jaxserve.model.quant import BF16_MIN_ROWS, matmul, quantize_int4

from tiny import make_llm, step_logits


@pytest.mark.parametrize("shape", [(1, 256), (1, 1, 256), (5, 256)])
def test_bf16_product_is_the_float32_product_rounded_to_bf16(shape):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 96)) * 0.05, jnp.bfloat16)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # the bf16 values' product, float32
    got = matmul(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (*shape[:-1], 96)
    # Accumulated in float32, rounded once to bf16 (8 bits of mantissa): half a unit in the last place.
    np.testing.assert_allclose(np.asarray(got, np.float32), exact, rtol=2 ** -8, atol=1e-6, err_msg=f"seed {seed}")


def test_bf16_product_with_int4_weights_is_xlas_dequantized_product():
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((1, 200)), jnp.bfloat16)
    w = quantize_int4(jnp.asarray(rng.standard_normal((200, 64)) * 0.05, jnp.float32))
    kernel = np.asarray(w.dequantize(jnp.bfloat16), np.float32)[:200]
    exact = np.asarray(x, np.float32) @ kernel
    np.testing.assert_allclose(np.asarray(matmul(x, w), np.float32), exact, rtol=2 ** -8, atol=1e-6,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_only_cpu_takes_a_float32_accumulating_bf16_dot_of_at_least_min_rows(platform):
    """XLA:CPU runs a bf16 dot with a bf16 result, or of one row, as a slow loop (3-7x float32's time), and a few
    rows faster padded to 8 (jaxserve.model.quant.bf16_dot_matmul): fewer rows get zero ones up to BF16_MIN_ROWS, and
    the dot returns float32. TPU and GPU keep x @ w as before. (Up to few_row_matmul.MAX_ROWS rows CPU runs the FFI
    kernel unless kernels=False, a tensor-parallel split: tests/cpu_kernels/test_cpu_kernels.py.)"""
    sds = jax.ShapeDtypeStruct
    w = sds((576, 192), jnp.bfloat16)
    for rows in (1, 3, BF16_MIN_ROWS, BF16_MIN_ROWS + 5):
        mm = jax.jit(lambda x, w: matmul(x, w, kernels=rows > few_row_matmul.MAX_ROWS["bfloat16"]))
        text = export.export(mm, platforms=[platform])(sds((rows, 576), jnp.bfloat16), w).mlir_module()
        m = max(rows, BF16_MIN_ROWS)
        fast = f"(tensor<{m}x576xbf16>, tensor<576x192xbf16>) -> tensor<{m}x192xf32>"
        assert (fast in text) == (platform == "cpu"), (platform, rows)


def test_bf16_pages_stored_as_bits_are_read_and_written_bit_for_bit():
    """A bf16 cache stored as uint16 bits (CPU: jaxserve.cache.kv_cache) reads back the bf16 values written, bit for
    bit, negative zeros and infinities included (a NaN's payload may not survive XLA:CPU's own copies); exported
    pages are bf16 and import back unchanged."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    config = SimpleNamespace(num_kv_heads=2, head_dim=5, num_layers=1)
    pages = init_kv_cache(config, 9, 4, jnp.bfloat16, bf16_as_bits=True)[0][0]  # [pages, kv_heads, page_size, 5]
    assert pages.dtype == jnp.uint16 and values_dtype(pages) == jnp.bfloat16
    assert init_kv_cache(config, 9, 4, jnp.bfloat16)[0][0].dtype == jnp.bfloat16  # unless asked for
    assert init_kv_cache(config, 9, 4, jnp.float32, bf16_as_bits=True)[0][0].dtype == jnp.float32

    new_bits = _finite_bf16_bits(rng, (3, 2, 5))  # [tokens, kv_heads, head_dim]
    new = jax.lax.bitcast_convert_type(jnp.asarray(new_bits), jnp.bfloat16)
    slots = np.asarray([4 * 3 + 1, 4 * 7 + 0, 4 * 7 + 3], np.int32)
    written = jax.jit(write_pages, donate_argnums=0)(pages, new, jnp.asarray(slots))
    want = np.zeros((9, 2, 4, 5), np.uint16)
    for t, s in enumerate(slots):
        want[s // 4, :, s % 4] = new_bits[t]
    assert written.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(written), want, err_msg=f"seed {seed}")

    ids = jnp.asarray([[3, 7], [0, 3]], jnp.int32)
    read = jax.jit(lambda p, i: read_head_major(p, i, jnp.bfloat16))(written, ids)
    assert read.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(read, jnp.uint16)), want[np.asarray(ids)],
                                  err_msg=f"seed {seed}")
    as_float = jax.jit(lambda p, i: read_head_major(p, i, jnp.float32, 3))(written, ids)
    np.testing.assert_array_equal(np.asarray(as_float), np.asarray(read, np.float32)[..., :3])

    exported = gather_pages([(written, written)], jnp.asarray([7, 3], jnp.int32))
    assert exported[0][0].dtype == jnp.bfloat16
    empty = init_kv_cache(config, 9, 4, jnp.bfloat16, bf16_as_bits=True)  # `pages` was donated to the write
    imported = scatter_pages(empty, jnp.asarray([1, 2], jnp.int32), exported)[0][1]
    assert imported.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(imported)[[1, 2]], want[[7, 3]])


def _whole_cache_ops(hlo: str, cache_elements: int) -> list[str]:
    """The compiled program's instructions (any computation) that compute an array of the cache's size: not a
    parameter, a loop's tuple element or a bitcast (free), so each one reads or writes a whole page array."""
    free = ("parameter", "get-tuple-element", "tuple", "bitcast")
    found = []
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = [a-z0-9]+\[([0-9,]*)\]\S* ([a-z-]+)\(", line)
        size = np.prod([int(d) for d in match.group(1).split(",") if d]) if match else 0
        if size == cache_elements and match.group(2) not in free:
            found.append(line.split(", metadata")[0].strip())
    return found


def test_a_bits_cache_is_written_in_place_and_read_by_its_blocks():
    """XLA:CPU converts a whole bf16 page array to float32 and back around a scatter into it, and a bf16 array
    gathered through any wider view is first rebuilt whole (engine steps 4-8x slower with 1025 pages: the module
    docstring of jaxserve.cache.kv_cache). Stored as bits: the cache write is the one scatter, in place, and the
    attention's reads (a decode batch's and a prompt chunk's) touch no whole page array."""
    num_pages, kv_heads, page_size, head_dim = 37, 2, 4, 16
    pages = jax.ShapeDtypeStruct((num_pages, kv_heads, page_size, head_dim), jnp.uint16)
    elements = num_pages * kv_heads * page_size * head_dim
    sds = jax.ShapeDtypeStruct
    write = jax.jit(write_pages, donate_argnums=0).lower(pages, sds((3, kv_heads, head_dim), jnp.bfloat16),
                                                         sds((3,), jnp.int32)).compile().as_text()
    ops = _whole_cache_ops(write, elements)
    assert ops and all("scatter" in op for op in ops), ops  # the scatter (and the fusion wrapping it) alone
    for tokens, rows, cached in [(4, 4, 9), (80, 1, 0), (80, 2, 7)]:  # decode rows; a chunk after a decode row
        ids = jnp.zeros(tokens, jnp.int32)
        table = jnp.zeros((rows, 8), jnp.int32)
        ragged = RaggedRows(positions=ids, token_row=ids, query_start=jnp.zeros(rows + 1, jnp.int32),
                            cached_lens=jnp.full(rows, cached, jnp.int32), page_table=table)
        q = sds((tokens, 4, head_dim), jnp.bfloat16)
        k = sds((tokens, kv_heads, head_dim), jnp.bfloat16)
        hlo = jax.jit(ragged_attention).lower(q, k, k, pages, pages, jax.eval_shape(lambda: ragged)).compile()
        assert not _whole_cache_ops(hlo.as_text(), elements), (tokens, rows)
    # The same check sees the bf16 cache's whole-array conversions.
    bf16 = jax.ShapeDtypeStruct(pages.shape, jnp.bfloat16)
    plain = jax.jit(write_pages, donate_argnums=0).lower(bf16, sds((3, kv_heads, head_dim), jnp.bfloat16),
                                                         sds((3,), jnp.int32)).compile().as_text()
    assert not all("scatter" in op for op in _whole_cache_ops(plain, elements))


def _finite_bf16_bits(rng, shape):
    """Random bf16 bit patterns that are not NaN (all 16 bits vary: signs, subnormals, zeros, infinities)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    nan = ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)
    bits[nan] &= 0xFF80  # an infinity instead
    bits.flat[0], bits.flat[1] = 0x8000, 0x0000  # -0 and +0
    return bits


def test_a_bf16_engine_on_cpu_keeps_its_cache_as_bits_with_the_same_logits(tiny_dir):
    """LLM(dtype="bfloat16") on CPU stores its cache as bits; a prompt's logits, and the next token's read back from
    the cache, are bit for bit the ones a plain bf16 cache gives."""
    llm = make_llm(tiny_dir, dtype="bfloat16")
    runner = llm.runner
    assert all(pages.dtype == jnp.uint16 for pages in jax.tree.leaves(runner.kv_cache))
    prompt = np.random.default_rng(0).integers(0, runner.config.vocab_size, 11).tolist()
    got = step_logits(llm, prompt[:-1]), step_logits(llm, prompt, cached=len(prompt) - 1)
    exported = runner.export_pages([1, 2])  # bf16, as any bf16 cache exports
    assert all(pages.dtype == jnp.bfloat16 for pages in jax.tree.leaves(exported))
    runner.import_pages([3, 4], exported)  # and imports
    runner.kv_cache = init_kv_cache(runner.config, len(runner.kv_cache[0][0]), runner.page_size, jnp.bfloat16)
    want = step_logits(llm, prompt[:-1]), step_logits(llm, prompt, cached=len(prompt) - 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
