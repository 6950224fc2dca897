"""The hand-written CPU kernels (jaxserve.cpu_kernels) against XLA's own lowering of the same product."""
import concurrent.futures
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.kv_cache import BF16_BITS, Int8Pages
from jaxserve.cpu_kernels import build, few_row_matmul, isa, paged_attention, trust
from jaxserve.model import quant
from jaxserve.model.attention import blocked_attention, ragged_attention

from locations import TESTS
from ragged import expected, random_ragged_case

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                                reason="no C++ compiler to build the CPU kernels")


def _operands(seed, fmt, rows, n_in, n_out):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_in, n_out)) * 0.05, jnp.float32)
    if fmt == "int8":
        w = quant.quantize_int8(w)
        dense = w.values.astype(jnp.float32) * w.scale  # [in, out]: exactly what the kernel multiplies
    else:
        w = w.astype(fmt)
        dense = w.astype(jnp.float32)
    return x, w, dense


def _uses_kernel(x, w, kernels=True) -> bool:
    text = jax.jit(lambda x, w: quant.matmul(x, w, kernels=kernels)).lower(x, w).as_text()
    return few_row_matmul.FLOAT_TARGET in text or few_row_matmul.INT8_TARGET in text


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, "max"])
# Inputs not a multiple of the kernel's 4-row groups, outputs past one 512-column block and not a vector's multiple;
# the longest input gives each thread several chunks.
@pytest.mark.parametrize("n_in,n_out", [(577, 1001), (64, 16), (3000, 96)])
def test_few_row_matmul_is_the_product_in_float32(fmt, rows, n_in, n_out):
    assert few_row_matmul.available(), "the CPU kernel did not build (see the jaxserve log)"
    rows = few_row_matmul.MAX_ROWS[fmt] if rows == "max" else rows
    seed = hash((fmt, rows, n_in, n_out)) % 2**31
    x, w, dense = _operands(seed, fmt, rows, n_in, n_out)
    assert _uses_kernel(x, w)
    got = jax.jit(quant.matmul)(x, w)  # [rows, out]
    want = jnp.dot(x, dense, precision="highest")
    # float32 sums in another order: the error scales with the sum of |terms|.
    bound = 1e-5 * jnp.dot(jnp.abs(x), jnp.abs(dense), precision="highest") + 1e-6
    assert got.shape == want.shape and got.dtype == x.dtype
    assert bool(jnp.all(jnp.abs(got - want) <= bound)), f"seed {seed}: max error {jnp.max(jnp.abs(got - want))}"


def test_bf16_activations_come_back_bf16():
    x, w, dense = _operands(0, "bfloat16", 2, 130, 70)
    got = jax.jit(quant.matmul)(x.astype(jnp.bfloat16), w)
    assert got.dtype == jnp.bfloat16
    want = jnp.dot(x.astype(jnp.bfloat16).astype(jnp.float32), dense, precision="highest")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)


def test_more_rows_tensor_parallel_and_int4_stay_with_xla():
    for fmt, limit in few_row_matmul.MAX_ROWS.items():
        x, w, _ = _operands(1, fmt, limit + 1, 64, 32)
        assert not _uses_kernel(x, w), fmt
        assert _uses_kernel(x[:limit], w), fmt
        assert not _uses_kernel(x[:1], w, kernels=False), fmt  # split over a mesh: the partitioner can't split it
    x, w, _ = _operands(2, "float32", 1, 64, 32)
    assert not _uses_kernel(x, quant.quantize_int4(w))


def test_the_kernel_refuses_more_rows_than_it_holds():
    x, w, _ = _operands(3, "float32", 9, 16, 16)
    with pytest.raises(Exception, match=r"x must be \[rows <= 8, in\]"):
        jax.jit(few_row_matmul.float_matmul)(x, w).block_until_ready()


def test_concurrent_calls_each_get_their_own_product():
    """Calls from several threads at once share XLA's pool: each call's helpers join that call's job only."""
    f = jax.jit(quant.matmul)
    cases = [_operands(seed, "float32", 1 + seed % 4, 2048, 640) for seed in range(8)]
    wants = [np.asarray(f(x, w)) for x, w, _ in cases]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            gots = list(pool.map(lambda c: np.asarray(f(c[0], c[1])), cases * 3))
            for i, got in enumerate(gots):
                np.testing.assert_array_equal(got, wants[i % len(cases)], err_msg=f"case {i % len(cases)}")


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """A fresh cache directory, no prebuilt library in the package's way, and the process's one warning not yet
    given: what load() sees on a new machine."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "no-prebuilt")
    monkeypatch.setattr(build.kernels_off, "given", False)
    monkeypatch.setattr(build.not_private, "given", False)
    return tmp_path


def test_a_compiler_that_fails_turns_the_kernels_off_with_a_warning(monkeypatch, own_cache, caplog):
    compiler = own_cache / "cxx"
    compiler.write_text('#!/bin/sh\necho "error: nope" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert build.load.__wrapped__("few_row_matmul.cc") is None
    assert "building few_row_matmul.cc failed, CPU kernels off" in caplog.text and "error: nope" in caplog.text
    assert not list((own_cache / "cpu_kernels").glob("*"))  # no half-built library left behind
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    assert build.load.__wrapped__("few_row_matmul.cc") is None


@pytest.mark.parametrize("where", ["/proc/x", "a file/sub"])
def test_an_unwritable_cache_turns_the_kernels_off_with_one_warning(monkeypatch, own_cache, caplog, where):
    """A read-only container, or a cache path that cannot be created (under a regular file: refused to root too):
    building into the cache fails, each kernel falls back to XLA, and the process says so once."""
    if where == "a file/sub":
        (own_cache / "a file").write_text("not a directory")
        where = str(own_cache / where)
    monkeypatch.setenv("JAXSERVE_CACHE", where)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert [build.load.__wrapped__(s) for s in build.sources()] == [None] * len(build.sources())
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "CPU kernels off" in warned[0] and where in warned[0], warned


def test_a_cache_others_can_write_is_neither_loaded_from_nor_built_in(own_cache, caplog):
    """A library in a directory writable by group or others could be anyone's code: it is not loaded, and the
    kernels are built in a private directory of the process instead, with one warning."""
    shared = own_cache / "cpu_kernels"
    shared.mkdir(mode=0o755)
    shared.chmod(0o777)  # a mode, not an access check: it holds for root too
    planted = shared / build.library_name("few_row_matmul.cc", isa.supported()[0])
    planted.write_bytes(b"not a library")  # loading it would raise OSError: the kernels would be off
    with caplog.at_level(logging.WARNING, logger="jaxserve"):  # one kernel: the rule is the same for each
        library = build.load.__wrapped__("few_row_matmul.cc")
    assert library is not None and Path(library._name).parent == build.private_dir()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "writable by others" in warned[0] and str(shared) in warned[0], warned
    assert planted.read_bytes() == b"not a library"


def test_a_library_another_user_could_have_written_is_not_loaded(own_cache):
    """Only this user's and root's own files in directories only they can write are loaded (judged where a
    symbolic link leads)."""
    directory = own_cache / "cpu_kernels"
    directory.mkdir(mode=0o700)
    library = directory / "x.so"
    library.write_bytes(b"")
    library.chmod(0o644)
    assert trust.why_untrusted(library) is None
    library.chmod(0o664)
    assert "writable by its group" in trust.why_untrusted(library)
    library.chmod(0o644)
    link = own_cache / "link"
    link.symlink_to(directory)
    directory.chmod(0o757)
    assert "writable by others" in trust.why_untrusted(link / "x.so")
    directory.chmod(0o1777)  # sticky, as /tmp: others cannot replace what is this user's
    assert trust.why_untrusted(library) is None
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(library, 4242, -1)
        assert "owned by another user (uid 4242)" in trust.why_untrusted(library)


def test_a_compiler_that_hangs_is_stopped_and_the_kernels_are_off(monkeypatch, own_cache, caplog):
    """A build that does not end within COMPILE_TIMEOUT_S is stopped, and the kernels are off with one warning
    instead of the step waiting forever. The compiler's own children are stopped too: a child left running holds
    the output pipes open, and load() would wait for it (here 1000 s) instead of returning."""
    compiler = own_cache / "cxx"
    compiler.write_text("#!/bin/sh\nsleep 1000 &\nexec sleep 1000\n")  # a child of its own, as g++'s cc1plus
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert build.load.__wrapped__("few_row_matmul.cc") is None
    assert "building few_row_matmul.cc took more than 0.5 s" in caplog.text and "CPU kernels off" in caplog.text
    assert not list((own_cache / "cpu_kernels").glob("*"))


def test_the_library_is_built_once_and_reused(own_cache):
    assert build.load.__wrapped__("few_row_matmul.cc") is not None
    built = list((own_cache / "cpu_kernels").glob("*.so"))
    assert [p.name for p in built] == [build.library_name("few_row_matmul.cc", isa.supported()[0])]
    mtime = built[0].stat().st_mtime_ns
    assert build.load.__wrapped__("few_row_matmul.cc") is not None
    assert built[0].stat().st_mtime_ns == mtime


def test_the_library_name_holds_the_variant_jaxlib_and_the_ffi_headers(monkeypatch):
    """An upgrade of jaxlib (or of its FFI headers) looks for another library: a stale one is never loaded."""
    v4, v3 = isa.variants("x86_64")[:2]
    before = build.library_name("few_row_matmul.cc", v4)
    assert before.startswith("few_row_matmul-x86-64-v4-") and before != build.library_name("few_row_matmul.cc", v3)
    monkeypatch.setattr(build.jaxlib, "__version__", "0.0.0-other")
    build.ffi_fingerprint.cache_clear()
    try:
        assert build.library_name("few_row_matmul.cc", v4) != before
    finally:
        monkeypatch.undo()
        build.ffi_fingerprint.cache_clear()
    assert build.library_name("few_row_matmul.cc", v4) == before


def test_the_variant_is_the_best_the_cpu_runs(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sse4_2"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    for flags, names in [(v4 | {"avx512_bf16"}, ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]),
                         (v4, ["x86-64-v4", "x86-64-v3", "x86-64"]),
                         (v3 | {"avx512_bf16"}, ["x86-64-v3", "x86-64"]),  # (not a CPU, but no AVX-512 is no v4)
                         (v3 | {"avx512f"}, ["x86-64-v3", "x86-64"]),  # AVX-512 without BW/DQ/VL is not v4
                         (v3 - {"fma"}, ["x86-64"]),
                         (set(), ["x86-64"])]:  # no /proc/cpuinfo: the baseline
        monkeypatch.setattr(isa, "cpu_features", lambda flags=flags: frozenset(flags))
        assert [v.name for v in isa.supported()] == names
    monkeypatch.setenv(isa.ENV_VARIANT, "x86-64-v4")  # asked for, but the CPU lacks it: none
    assert isa.supported() == ()
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(isa, "cpu_features", lambda: frozenset({"fp", "asimd", "atomics", "asimdrdm", "dcpop"}))
    monkeypatch.delenv(isa.ENV_VARIANT)
    assert [v.name for v in isa.supported()] == ["armv8.2-a", "armv8-a"]


@pytest.fixture(scope="module")
def every_variant(tmp_path_factory):
    """`jaxserve build-kernels`'s libraries, every kernel for every variant of this architecture, compiled with
    -Werror, in a cache directory of their own."""
    cache = tmp_path_factory.mktemp("prebuilt-cache")
    return cache, build.build_all(cache / "cpu_kernels", ("-Werror",))


def test_every_variant_builds_without_a_warning(every_variant):
    _, built = every_variant
    assert not built.refused
    assert sorted(p.name for p in built.written) == sorted(build.library_name(s, v) for s in build.sources()
                                                           for v in isa.variants())


RUN_PREBUILT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jaxserve.cpu_kernels import build, few_row_matmul, paged_attention
    from jaxserve.model import quant
    assert build.compiler() is None
    assert few_row_matmul.available() and paged_attention.available()
    print(build.load("few_row_matmul.cc")._name)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 300)), jnp.float32)
    w = quant.quantize_int8(jnp.asarray(np.random.default_rng(1).standard_normal((300, 70)), jnp.float32))
    text = jax.jit(quant.matmul).lower(x, w).as_text()
    assert few_row_matmul.INT8_TARGET in text
    want = jnp.dot(x, w.values.astype(jnp.float32) * w.scale, precision="highest")
    np.testing.assert_allclose(np.asarray(jax.jit(quant.matmul)(x, w)), np.asarray(want), rtol=1e-4, atol=1e-4)
""")


@pytest.mark.parametrize("variant", [v.name for v in isa.variants()])
def test_a_prebuilt_kernel_runs_without_a_compiler(every_variant, variant, tmp_path):
    """A machine with no compiler on PATH loads the prebuilt library of the variant it runs (the best one, or the
    one JAXSERVE_CPU_KERNELS_ISA names) and computes the product with it."""
    if variant not in [v.name for v in isa.supported()]:
        pytest.skip(f"this CPU does not run {variant}")
    cache, _ = every_variant
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path), JAXSERVE_CACHE=str(cache), **{isa.ENV_VARIANT: variant},
               PYTHONPATH=os.pathsep.join([str(build.SOURCE_DIR.parents[1]), str(TESTS)]))
    r = subprocess.run([sys.executable, "-c", RUN_PREBUILT], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr
    loaded = os.path.basename(r.stdout.strip().splitlines()[-1])
    assert loaded == build.library_name("few_row_matmul.cc", next(v for v in isa.variants() if v.name == variant))


def _stored_pages(pages, stored, pad_to):
    """float32 pages [num_pages, kv_heads, page_size, D] as the cache stores them, head_dim padded with junk to
    pad_to (a TPU-padded cache's layout: readers must cut it)."""
    rng = np.random.default_rng(0)
    junk = rng.standard_normal((*pages.shape[:-1], pad_to - pages.shape[-1])).astype(np.float32) * 100
    pages = jnp.asarray(np.concatenate([pages, junk], axis=-1))
    if stored == "int8":
        scale = jnp.max(jnp.abs(pages), axis=-1) / 127.0
        return Int8Pages(jnp.round(pages / scale[..., None]).astype(jnp.int8), scale)
    if stored == "bf16 bits":
        return jax.lax.bitcast_convert_type(pages.astype(jnp.bfloat16), BF16_BITS)
    return pages


@pytest.mark.parametrize("stored", ["float32", "int8", "bf16 bits"])
@pytest.mark.parametrize("window", [None, 7])
# Any head_dim (20), and those with loops of their own.
@pytest.mark.parametrize("head_dim,page_size", [(20, 4), (64, 32), (128, 16), (256, 8)])
def test_paged_attention_is_the_blocked_walk(stored, window, head_dim, page_size):
    """A few-token step's attention by the kernel (cached keys read in place, then the step's own) equals the
    blocked jnp path over the same pages (and, for float32 pages, the dense oracle): decode rows and short prompt
    chunks (more own keys than a block of 16) with and without a cached prefix, padding tokens and rows, a sliding
    window, a head_dim the pages pad."""
    assert paged_attention.available(), "the CPU kernel did not build (see the jaxserve log)"
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    lengths = ([(int(rng.integers(1, 300)), 1) for _ in range(3)]
               + [(int(rng.integers(0, 2)) * int(rng.integers(0, 100)), int(rng.integers(2, 28))) for _ in range(2)])
    case = random_ragged_case(rng, lengths, page_size=page_size, heads=6, kv_heads=2, head_dim=head_dim)
    k_pages, v_pages = (_stored_pages(p, stored, head_dim + 4) for p in (case.k_pages, case.v_pages))
    args = (case.q, case.k, case.v, k_pages, v_pages, case.rows)
    in_place = jax.jit(lambda *a: ragged_attention(*a, sliding_window=window))
    assert paged_attention.TARGET in in_place.lower(*args).as_text()
    got = np.asarray(in_place(*args))
    walked = np.asarray(blocked_attention(*args, sliding_window=window))
    np.testing.assert_allclose(got, walked, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")
    if stored == "float32":
        np.testing.assert_allclose(got, expected(case, window), rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim,page_size", [(20, 4), (64, 32), (128, 16), (256, 8)])
def test_bf16_dots_are_the_float32_products_within_bf16_rounding(window, head_dim, page_size):
    """A bf16 model's step (q, k, v in bf16, pages of bf16 bits) asks the kernel for bf16 dots: where the CPU has
    AVX-512-BF16 (and head_dim is 64, 128 or 256), the cached keys' products take q and the softmax weights rounded
    to bf16, within bf16's rounding of the float32 products; other pages, and head_dims without a loop of their
    own, are not touched by the request."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    lengths = [(int(rng.integers(1, 300)), 1) for _ in range(4)] + [(int(rng.integers(0, 60)), 20)]
    case = random_ragged_case(rng, lengths, page_size=page_size, heads=6, kv_heads=2, head_dim=head_dim)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (case.q, case.k, case.v))
    rows = case.rows
    in_place = jax.jit(lambda *a: ragged_attention(*a, sliding_window=window))
    call = jax.jit(paged_attention.paged_attention, static_argnames=("sliding_window", "bf16_dots"))
    for stored in ("bf16 bits", "int8", "float32"):
        k_pages, v_pages = (_stored_pages(p, stored, head_dim + 4) for p in (case.k_pages, case.v_pages))
        scales = (k_pages.scale, v_pages.scale) if stored == "int8" else (None, None)
        stored_k, stored_v = (p.values if stored == "int8" else p for p in (k_pages, v_pages))
        G = q.shape[1] // k.shape[1]
        operands = (q.reshape(q.shape[0], k.shape[1], G, head_dim) * head_dim ** -0.5, k, v,  # scaled in bf16
                    rows.token_row, rows.positions, rows.cached_lens[rows.token_row], rows.page_table[rows.token_row],
                    stored_k, stored_v, *scales)
        dots, products = (np.asarray(call(*operands, sliding_window=window, bf16_dots=d)) for d in (True, False))
        if stored != "bf16 bits" or head_dim == 20 or not _runs_bf16_dots():
            np.testing.assert_array_equal(dots, products, err_msg=f"{stored}, seed {seed}")
            continue
        assert not np.array_equal(dots, products), f"the bf16 dots did not run, seed {seed}"
        np.testing.assert_allclose(dots, products, rtol=1e-2, atol=1e-2, err_msg=f"seed {seed}")
        # The model's path asks for them (its q may carry XLA's excess precision: rounded again in the kernel).
        got = np.asarray(in_place(q, k, v, k_pages, v_pages, rows), np.float32)
        np.testing.assert_allclose(got, products.reshape(got.shape), rtol=2e-2, atol=2e-2, err_msg=f"seed {seed}")


def _runs_bf16_dots() -> bool:
    """The kernel loaded is the variant with AVX-512-BF16 (its library's name says which)."""
    library = build.load("paged_attention.cc")
    return library is not None and Path(library._name).name.startswith("paged_attention-x86-64-v4-bf16-")


def test_paged_attention_refuses_a_table_that_would_read_outside_the_cache():
    q = jnp.zeros((1, 2, 3, 8), jnp.float32)  # [T, kv_heads, G, D]
    k = jnp.zeros((1, 2, 8), jnp.float32)  # [T, kv_heads, D]
    pages = jnp.zeros((5, 2, 4, 8), jnp.float32)  # [num_pages, kv_heads, page_size, D]
    one = jnp.asarray([0], jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    call = jax.jit(paged_attention.paged_attention)
    ok = call(q, k, k, one, lens, lens, jnp.asarray([[1, 4]], jnp.int32), pages, pages)
    assert ok.shape == (1, 2, 3, 8)
    with pytest.raises(Exception, match="a page id outside the cache"):
        jax.block_until_ready(call(q, k, k, one, lens, lens, jnp.asarray([[1, 5]], jnp.int32), pages, pages))
    long = jnp.asarray([9], jnp.int32)  # more keys than two pages of 4 hold
    with pytest.raises(Exception, match="cached length exceeds its pages"):
        jax.block_until_ready(call(q, k, k, one, long, long, jnp.asarray([[1, 4]], jnp.int32), pages, pages))
