"""dtype="bfloat16" on CPU: the matmul through XLA:CPU's fast bf16 kernel (bf16 x bf16 accumulated into float32, at
least two rows: `jaxserve.quant.bf16_dot_matmul`), and bf16 KV pages read and written by their bits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.cache.kv_cache import take_pages, write_pages
from jaxserve.quant import matmul, quantize_int4


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
def test_only_cpu_takes_a_float32_accumulating_bf16_dot_of_two_rows_or_more(platform):
    """XLA:CPU runs a bf16 dot with a bf16 result, or of one row, as a slow loop (3-7x float32's time,
    jaxserve.quant.bf16_dot_matmul): one row gets a second, zero one, and the dot returns float32. TPU and GPU keep
    x @ w as before."""
    sds = jax.ShapeDtypeStruct
    w = sds((576, 192), jnp.bfloat16)
    for rows in (1, 8):
        text = export.export(jax.jit(matmul), platforms=[platform])(sds((rows, 576), jnp.bfloat16), w).mlir_module()
        fast = f"(tensor<{max(rows, 2)}x576xbf16>, tensor<576x192xbf16>) -> tensor<{max(rows, 2)}x192xf32>"
        assert (fast in text) == (platform == "cpu"), (platform, rows)


def test_bf16_pages_are_gathered_and_scattered_bit_for_bit():
    """take_pages gathers bf16 pages as 32-bit words and write_pages scatters them as uint16 (XLA:CPU gathers bf16
    rows element by element, and scatters bf16 through a float32 copy of the whole array): the same bits as plain
    indexing, negative zeros and infinities included (a NaN's payload may not survive XLA:CPU's own copies)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    bits = _finite_bf16_bits(rng, (9, 2, 4, 6))  # [pages, kv_heads, page_size, head_dim]
    pages = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 9, (3, 2)), jnp.int32)
    got = jax.lax.bitcast_convert_type(jax.jit(take_pages)(pages, ids), jnp.uint16)
    np.testing.assert_array_equal(np.asarray(got), bits[np.asarray(ids)], err_msg=f"seed {seed}")

    new_bits = _finite_bf16_bits(rng, (3, 2, 5))  # [tokens, kv_heads, head_dim < stored]
    new = jax.lax.bitcast_convert_type(jnp.asarray(new_bits), jnp.bfloat16)
    slots = np.asarray([4 * 3 + 1, 4 * 7 + 0, 4 * 7 + 3], np.int32)
    written = jax.jit(write_pages, donate_argnums=0)(pages, new, jnp.asarray(slots))
    want = bits.copy()
    for t, s in enumerate(slots):
        want[s // 4, :, s % 4] = 0  # the stored head_dim's padding
        want[s // 4, :, s % 4, :5] = new_bits[t]
    assert written.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(written, jnp.uint16)), want,
                                  err_msg=f"seed {seed}")


def _finite_bf16_bits(rng, shape):
    """Random bf16 bit patterns that are not NaN (all 16 bits vary: signs, subnormals, zeros, infinities)."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    nan = ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)
    bits[nan] &= 0xFF80  # an infinity instead
    bits.flat[0], bits.flat[1] = 0x8000, 0x0000  # -0 and +0
    return bits
