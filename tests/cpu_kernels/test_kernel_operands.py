"""The CPU kernels refuse operands that do not go together, naming the operand, rather than reading or writing past
one (a `v` [T, H, 1] beside a head_dim of 64 was a read past v and NaNs; an int8 scale too short, a read past it; a
page size of 0 or no tokens, a division by zero that killed the process): the Python wrappers at trace time, and
the C++ handlers too, for a call that goes to XLA's FFI directly."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cpu_kernels import few_row_matmul, paged_attention

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                                reason="no C++ compiler to build the CPU kernels")

T, H, G, D, PAGES, PAGE = 2, 2, 3, 64, 5, 4


def attention_operands(seed):
    """A valid call: two decode tokens of two rows, each with 6 cached keys on two pages."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return dict(q=f32(T, H, G, D), k=f32(T, H, D), v=f32(T, H, D), token_row=jnp.asarray([0, 1], jnp.int32),
                positions=jnp.asarray([6, 6], jnp.int32), cached_lens=jnp.asarray([6, 6], jnp.int32),
                page_ids=jnp.asarray([[1, 4], [2, 3]], jnp.int32), k_pages=f32(PAGES, H, PAGE, D),
                v_pages=f32(PAGES, H, PAGE, D))


def int8_operands(seed):
    ops = attention_operands(seed)
    for name in ("k_pages", "v_pages"):
        ops[name] = jnp.clip(jnp.round(ops[name] * 40), -127, 127).astype(jnp.int8)
    ops.update(k_scale=jnp.full((PAGES, H, PAGE), 0.025, jnp.float32),
               v_scale=jnp.full((PAGES, H, PAGE), 0.025, jnp.float32))
    return ops


# Each operand wrong in the way that would have read past it (or past another through the sizes it gives).
BAD_ATTENTION = [
    ("v", lambda o: jnp.zeros((T, H, 1), jnp.float32)),  # the case: [T, H, 1] with D = 64
    ("k", lambda o: jnp.zeros((T, H, D // 2), jnp.float32)),
    ("q", lambda o: jnp.zeros((T, H, 65, D), jnp.float32)),  # more query heads per KV head than the kernel holds
    ("token_row", lambda o: jnp.zeros((1,), jnp.int32)),
    ("positions", lambda o: jnp.zeros((T + 1,), jnp.int32)),
    ("cached_lens", lambda o: jnp.zeros((1,), jnp.int32)),
    ("page_ids", lambda o: jnp.zeros((1, 2), jnp.int32)),
    ("k_pages", lambda o: jnp.zeros((PAGES, H, PAGE, D // 2), jnp.float32)),  # narrower than head_dim
    ("k_pages", lambda o: jnp.zeros((PAGES, H + 1, PAGE, D), jnp.float32)),
    ("v_pages", lambda o: jnp.zeros((PAGES - 2, H, PAGE, D), jnp.float32)),
    ("v_pages", lambda o: o["v_pages"].astype(jnp.bfloat16)),
]


def call_wrapper(ops):
    return jax.block_until_ready(jax.jit(paged_attention.paged_attention)(**ops))


def call_ffi(ops, out_shape=None):
    """The handler itself, past the wrapper's checks (as any caller of the registered target could)."""
    assert paged_attention.available()
    none = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(paged_attention.TARGET, jax.ShapeDtypeStruct(out_shape or ops["q"].shape, jnp.float32))
    args = [ops[n] for n in ("q", "k", "v", "token_row", "positions", "cached_lens", "page_ids", "k_pages",
                             "v_pages")] + [ops.get("k_scale", none), ops.get("v_scale", none)]
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, sliding_window=0, bf16_dots=False))(*args))


@pytest.mark.parametrize("operand,bad", BAD_ATTENTION, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ATTENTION)])
def test_paged_attention_names_the_operand_that_does_not_fit(operand, bad):
    ops = attention_operands(0)
    good = np.asarray(call_wrapper(ops))
    assert np.isfinite(good).all()
    ops[operand] = bad(ops)
    with pytest.raises(ValueError, match=f"paged attention: {operand} must be"):
        call_wrapper(ops)
    with pytest.raises(Exception, match=f"paged attention: {operand} must be"):
        call_ffi(ops)


@pytest.mark.parametrize("operand", ["k_scale", "v_scale"])
def test_int8_pages_need_a_scale_per_page_head_and_slot(operand):
    ops = int8_operands(1)
    assert np.isfinite(np.asarray(call_wrapper(ops))).all()
    for bad in (None, jnp.ones((3,), jnp.float32), jnp.ones((PAGES, H, PAGE), jnp.bfloat16)):
        with pytest.raises(ValueError, match=f"{operand} must be float32 \\[5, 2, 4\\]"):
            call_wrapper({**ops, operand: bad})
    ops[operand] = jnp.ones((3,), jnp.float32)  # the read past the scales
    with pytest.raises(Exception, match=f"paged attention: {operand} must be a float32 scale per page"):
        call_ffi(ops)
    del ops[operand]  # none at all: an empty buffer
    with pytest.raises(Exception, match=f"{operand} must be a float32 scale per page"):
        call_ffi(ops)
    with pytest.raises(ValueError, match="k_scale must be None for float pages"):
        call_wrapper({**attention_operands(1), "k_scale": jnp.ones((PAGES, H, PAGE), jnp.float32)})


def test_paged_attention_checks_its_result_shape_and_survives_empty_operands():
    ops = attention_operands(2)
    with pytest.raises(Exception, match="paged attention: out must be q's shape"):
        call_ffi(ops, out_shape=(T, H, G, D + 1))
    # No tokens (a division by their count), pages of size 0 (a division by it): both ended the process.
    empty = {**ops, **{n: ops[n][:0] for n in ("q", "k", "v", "token_row", "positions", "cached_lens", "page_ids")}}
    assert call_ffi(empty).shape == (0, H, G, D)
    assert call_wrapper(empty).shape == (0, H, G, D)
    flat = {**ops, "k_pages": jnp.zeros((PAGES, H, 0, D)), "v_pages": jnp.zeros((PAGES, H, 0, D))}
    with pytest.raises(Exception, match="k_pages must be"):
        call_ffi(flat)


def test_a_window_past_the_table_reads_no_page():
    """A position far past its row's cached keys with a sliding window sees only its own key: the kernel reads no
    page for it (it read the page table at the window's page, a gigabyte past the table's end)."""
    ops = attention_operands(3)
    ops.update(positions=jnp.asarray([1 << 30, -1], jnp.int32), cached_lens=jnp.asarray([2, 0], jnp.int32))
    got = np.asarray(jax.jit(lambda o: paged_attention.paged_attention(**o, sliding_window=4))(ops))
    want = np.broadcast_to(np.asarray(ops["v"])[0][:, None, :], (H, G, D))  # its own value, the one key it sees
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    assert not got[1].any()  # padding: zeros


def matmul_operands(seed, rows=2, n_in=40, n_out=24):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_in, n_out)), jnp.float32)
    values = jnp.asarray(rng.integers(-127, 128, (n_in, n_out)), jnp.int8)
    return x, w, values, jnp.asarray(rng.random(n_out), jnp.float32)


def test_few_row_matmul_names_the_operand_that_does_not_fit():
    assert few_row_matmul.available()
    x, w, values, scale = matmul_operands(4)
    float_matmul, int8_matmul = jax.jit(few_row_matmul.float_matmul), jax.jit(few_row_matmul.int8_matmul)
    with pytest.raises(ValueError, match=r"the weight must be float32/bfloat16 \[in = 40, out\]"):
        float_matmul(x, w[:-1])
    with pytest.raises(ValueError, match="the weight must be float32/bfloat16"):
        float_matmul(x, w.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"the weight must be int8 \[in = 40, out\]"):
        int8_matmul(x, values.T, scale)
    with pytest.raises(ValueError, match=r"scale must be \[out\] = \[24\]"):
        int8_matmul(x, values, scale[:3])  # the kind: a read past the scales
    # The handlers, past the wrappers.
    int8_ffi = jax.ffi.ffi_call(few_row_matmul.INT8_TARGET, jax.ShapeDtypeStruct((2, 24), jnp.float32))
    with pytest.raises(Exception, match=r"scale must be \[out\] = \[24\]"):
        jax.block_until_ready(jax.jit(int8_ffi)(x, values, scale[:3]))
    float_ffi = jax.ffi.ffi_call(few_row_matmul.FLOAT_TARGET, jax.ShapeDtypeStruct((2, 23), jnp.float32))
    with pytest.raises(Exception, match=r"the result must be \[rows, out\] = \[2, 24\]"):
        jax.block_until_ready(jax.jit(float_ffi)(x, w))
    float_ffi = jax.ffi.ffi_call(few_row_matmul.FLOAT_TARGET, jax.ShapeDtypeStruct((2, 24), jnp.float32))
    with pytest.raises(Exception, match=r"w must be \[in, out\], in = 39"):
        jax.block_until_ready(jax.jit(float_ffi)(x[:, :-1], w))


def test_few_row_matmul_of_no_rows_is_empty():
    """No rows wrote eight rows' products into an empty result (the kernel's widest case): now an empty product,
    and the handler returns at once."""
    x, w, values, scale = matmul_operands(5, rows=0)
    assert jax.jit(few_row_matmul.float_matmul)(x, w).shape == (0, 24)
    assert jax.jit(few_row_matmul.int8_matmul)(x.reshape(0, 1, 40), values, scale).shape == (0, 1, 24)
    ffi = jax.ffi.ffi_call(few_row_matmul.FLOAT_TARGET, jax.ShapeDtypeStruct((0, 24), jnp.float32))
    assert jax.block_until_ready(jax.jit(ffi)(x, w)).shape == (0, 24)
