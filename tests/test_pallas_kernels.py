"""The Pallas kernels in interpret mode on CPU against their jnp references, on fresh random inputs: odd lengths
crossing page and block boundaries, page sizes 8/16/32, GQA ratios 1/3/8, head dims 64/128, float32 and bfloat16,
sliding window and soft-cap; int8 pages (Int8Pages) against the reference reading the same pages; outputs start
poisoned with NaN and must be fully overwritten."""
import numpy as np
import jax.numpy as jnp
import pytest

from jaxserve.attention import attention, paged_attention_reference as model_attention_reference
from jaxserve.attention import resolve_attention_backend
from jax.experimental.pallas import tpu as pltpu
from jaxserve.pallas_kernels import (flash_attention, flash_attention_reference, flash_attention_tpu,
                                     paged_attention, paged_attention_reference, paged_attention_tpu)
from jaxserve.pallas_kernels.self_check import quantize_pages

# The GPU kernels start from outputs poisoned with NaN (aliased); the TPU interpreter fills every uninitialised
# buffer with NaN itself. Either way an element the kernel does not write shows.
NAN_MEMORY = pltpu.InterpretParams(uninitialized_memory="nan")
# Small row blocks, so a verification batch of 3 queries x 8 heads spans several.
PAGED = {"gpu": lambda *a, **kw: paged_attention(*a, block_pages=2, max_rows=16, interpret=True, poison=True, **kw),
         "tpu": lambda *a, **kw: paged_attention_tpu(*a, max_rows=8, interpret=NAN_MEMORY, **kw)}
FLASH = {"gpu": lambda *a, **kw: flash_attention(*a, block_q=16, block_k=16, interpret=True, poison=True, **kw),
         "tpu": lambda *a, **kw: flash_attention_tpu(*a, block_q=16, block_k=16, interpret=NAN_MEMORY, **kw)}

TOL = {jnp.float32: dict(atol=3e-5, rtol=3e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
CASES = [  # (page_size, kv_heads, group, head_dim, dtype, sliding_window, soft_cap)
    (8, 2, 1, 64, jnp.float32, None, None),
    (16, 1, 3, 128, jnp.float32, None, None),
    (32, 1, 8, 64, jnp.bfloat16, None, None),
    (16, 2, 3, 64, jnp.bfloat16, 20, None),
    (8, 1, 8, 128, jnp.float32, None, 30.0),
    (32, 2, 1, 128, jnp.float32, 37, 50.0),
]


def fresh_rng():
    """New inputs every run; the seed goes into failure messages so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def check(got, want, dtype, seed):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), f"NaN in the output (an element never written, or a bad mask); seed {seed}"
    np.testing.assert_allclose(got, want, err_msg=f"seed {seed}", **TOL[dtype])


def paged_inputs(rng, page_size, kvh, group, head_dim, dtype, queries):
    """Random pages, queries and page table; ragged lengths with verification-style positions."""
    S, pages_per_seq = 4, 7
    num_pages = S * pages_per_seq + 1
    k_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, kvh, head_dim)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, kvh, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((S, queries, kvh * group, head_dim)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[:S * pages_per_seq].reshape(S, pages_per_seq))
    # Ragged lengths, odd and crossing pages and blocks; one row is padding (sees nothing).
    kv_lens = rng.integers(1, pages_per_seq * page_size - queries, S)
    kv_lens[-1] = 0
    # Queries whose keys are already in the pages (verification): causal among themselves.
    positions = kv_lens[:, None] - queries + np.arange(queries)[None, :]
    positions[-1] = -1
    kv_lens, positions = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(np.maximum(positions, -1), jnp.int32)
    return q, k_pages, v_pages, table, kv_lens, positions


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("page_size,kvh,group,head_dim,dtype,window,soft_cap", CASES)
@pytest.mark.parametrize("queries", [1, 3])
def test_paged_attention_matches_reference(target, page_size, kvh, group, head_dim, dtype, window, soft_cap,
                                           queries):
    rng, seed = fresh_rng()
    q, k_pages, v_pages, table, kv_lens, positions = paged_inputs(rng, page_size, kvh, group, head_dim, dtype,
                                                                  queries)
    check_paged(target, seed, dtype, q, k_pages, v_pages, table, kv_lens, positions, window, soft_cap)


def check_paged(target, seed, dtype, q, k_pages, v_pages, table, kv_lens, positions, window, soft_cap):
    """The paged kernel of `target` against the reference on the same inputs: output and log-sum-exp."""
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out, lse = PAGED[target](q, k_pages, v_pages, table, kv_lens, positions, **kw)
    want_out, want_lse = paged_attention_reference(q, k_pages, v_pages, table, kv_lens, positions, **kw)
    check(out, want_out, dtype, seed)
    check(lse, want_lse, jnp.float32, seed)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("page_size,kvh,group,head_dim,dtype,window,soft_cap,queries", [
    (8, 2, 3, 64, jnp.float32, None, None, 3),
    (16, 1, 8, 128, jnp.bfloat16, None, None, 1),
    (32, 2, 1, 64, jnp.bfloat16, 20, 30.0, 3),
])
def test_paged_attention_reads_int8_pages(target, page_size, kvh, group, head_dim, dtype, window, soft_cap,
                                          queries):
    """Int8Pages quantized as the cache writes them: the kernels dequantize to q's dtype as the reference does, so
    the tolerance is that of float pages."""
    rng, seed = fresh_rng()
    q, k_pages, v_pages, table, kv_lens, positions = paged_inputs(rng, page_size, kvh, group, head_dim,
                                                                  jnp.float32, queries)
    k_pages, v_pages, q = quantize_pages(k_pages), quantize_pages(v_pages), q.astype(dtype)
    check_paged(target, seed, dtype, q, k_pages, v_pages, table, kv_lens, positions, window, soft_cap)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("page_size,kvh,group,head_dim,dtype,window,soft_cap", CASES)
def test_flash_attention_matches_reference(target, page_size, kvh, group, head_dim, dtype, window, soft_cap):
    rng, seed = fresh_rng()
    B, T = 4, int(rng.integers(17, 60))
    # Rows: a fresh prompt; a chunk after a contiguous prefix; shorter than the padded shapes; queries far past
    # every key (with a window they see nothing).
    prefix = int(rng.integers(1, 40))
    L = T + prefix
    q_start = jnp.asarray([0, prefix, 0, L + 30])
    k_start = jnp.asarray([0, 0, 0, 0])
    q_lens = jnp.asarray([T, T, T // 2, T])
    k_lens = jnp.asarray([T, L, T // 2, L])
    q = jnp.asarray(rng.standard_normal((B, T, kvh * group, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((B, L, kvh, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((B, L, kvh, head_dim)), dtype)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    out, lse = FLASH[target](q, k, v, q_start, k_start, q_lens, k_lens, **kw)
    want_out, want_lse = flash_attention_reference(q, k, v, q_start, k_start, q_lens, k_lens, **kw)
    check(out, want_out, dtype, seed)
    check(lse, want_lse, jnp.float32, seed)


@pytest.mark.parametrize("backend", ["pallas-gpu-interpret", "pallas-tpu-interpret"])
@pytest.mark.parametrize("window,kv_cache_dtype", [(None, "auto"), (11, "auto"), (11, "int8")])
def test_model_attention_through_the_kernels_matches_the_reference(backend, window, kv_cache_dtype):
    """The engine's call: cached pages by the paged kernel, the step's own keys by flash, merged."""
    rng = np.random.default_rng()
    S, Q, KVH, G, D, page_size, P = 3, 9, 2, 3, 64, 8, 6
    num_pages = S * P + 1
    k_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, KVH, D)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, page_size, KVH, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(S, P))
    q = jnp.asarray(rng.standard_normal((S, Q, KVH * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((S, Q, KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((S, Q, KVH, D)), jnp.float32)
    if kv_cache_dtype == "int8":
        k_pages, v_pages = quantize_pages(k_pages), quantize_pages(v_pages)
    starts, counts = [0, 21, 30], [9, 5, 1]  # fresh prompt, chunk after a cached prefix, decode-like; padding
    positions = np.full((S, Q), -1)
    for i, (s, n) in enumerate(zip(starts, counts)):
        positions[i, :n] = np.arange(s, s + n)
    positions = jnp.asarray(positions, jnp.int32)
    args = (q, k, v, k_pages, v_pages, table, positions)
    got = attention(*args, sliding_window=window, backend=backend)
    want = model_attention_reference(*args, sliding_window=window)
    real = np.asarray(positions) >= 0  # padding queries' outputs are unused
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=3e-5, rtol=3e-5)


def test_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "reference"
    assert resolve_attention_backend("auto", "gpu") == "pallas-gpu"
    assert resolve_attention_backend("auto", "tpu") == "pallas-tpu"
    assert resolve_attention_backend("pallas", "tpu") == "pallas-tpu"
    assert resolve_attention_backend("pallas", "cpu") == "pallas-gpu-interpret"
    assert resolve_attention_backend("pallas-tpu", "cpu") == "pallas-tpu-interpret"
    with pytest.raises(ValueError, match="cannot run on gpu"):
        resolve_attention_backend("pallas-tpu", "gpu")
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", "cpu")


@pytest.mark.parametrize("backend,kv_cache_dtype", [("pallas-gpu", "auto"), ("pallas-tpu", "auto"),
                                                    ("pallas-tpu", "int8")])
def test_engine_with_the_pallas_backend_gives_the_reference_tokens(tmp_path, backend, kv_cache_dtype):
    from hf_models import save_tiny_model
    from jaxserve import SamplingParams
    from tiny import make_llm, prompts
    save_tiny_model("mistral-sliding", tmp_path)  # GQA 2:1 and a 12-token sliding window
    ps = prompts(np.random.default_rng(), [5, 23, 40])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = make_llm(str(tmp_path), kv_cache_dtype=kv_cache_dtype)
    want = [o.outputs[0].token_ids for o in reference.generate(ps, sp, use_tqdm=False)]
    llm = make_llm(str(tmp_path), attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)] == want


def test_kernel_benchmark_script_runs(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, "scripts/bench_kernels.py", "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    results = json.loads(out.read_text())
    assert len(results["paged"]) == len(results["flash"]) == 2  # both kernel sets
    assert all(r["max_abs_err"] < 1e-4 for r in results["paged"] + results["flash"])
    assert results["quantized"] and all(r["int8_rel_err"] < 1e-5 and r["int4_rel_err"] < 1e-5
                                        for r in results["quantized"])


def test_start_up_check_accepts_good_kernels_and_reports_failures(monkeypatch):
    from jaxserve.pallas_kernels import self_check
    serving = dict(num_pages=40, pages_per_seq=8, max_num_seqs=4, max_chunk=32)
    assert self_check.check_kernels("pallas-gpu-interpret", 6, 2, 64, 8, jnp.float32, 5, serving) is None
    assert self_check.check_kernels("pallas-gpu-interpret", 6, 2, 64, 8, jnp.float32, 5, serving,
                                    kv_cache_dtype="int8") is None
    broken = (lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("cannot lower")), None)
    monkeypatch.setattr(self_check, "kernels_for", lambda backend: broken)
    assert "cannot lower" in self_check.check_kernels("pallas-gpu", 6, 2, 64, 8, jnp.float32)


def test_auto_falls_back_to_the_reference_when_the_check_fails(monkeypatch, caplog):
    from jaxserve import engine
    from jaxserve.pallas_kernels import self_check
    from jaxserve.config import ModelConfig
    config = ModelConfig("LlamaForCausalLM", 320, 64, 128, 2, 4, 2, 16)
    monkeypatch.setattr(self_check, "check_kernels", lambda *a, **kw: "cannot lower")
    assert engine._checked_backend("pallas-gpu", "auto", config, 16, jnp.bfloat16) == "reference"
    assert "cannot lower" in caplog.text
    with pytest.raises(RuntimeError, match="cannot lower"):
        engine._checked_backend("pallas-gpu", "pallas", config, 16, jnp.bfloat16)


@pytest.mark.parametrize("target,platform", [("pallas-gpu", "cuda"), ("pallas-tpu", "tpu")])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])  # a serving size; SmolLM2
def test_kernels_lower_for_their_hardware(monkeypatch, target, platform, heads, kv_heads, head_dim):
    """Lowering for a platform runs here without one: Pallas' Triton and Mosaic TPU lowerings check block shapes
    and ops (the device compiler's own checks still wait for hardware). The paged kernel with float and int8 pages."""
    import jax
    from jax import export
    from jax._src.pallas.mosaic import tpu_info
    from jaxserve.cache.kv_cache import Int8Pages
    from jaxserve.pallas_kernels import kernels_for
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")  # Mosaic asks which chip it targets
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    sds, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    num_pages, T = 1024, 512
    pages = sds((num_pages, 16, kv_heads, head_dim), bf16)
    int8_pages = Int8Pages(sds((num_pages, 16, kv_heads, head_dim), jnp.int8), sds((num_pages, 16, kv_heads),
                                                                                   jnp.float32))
    paged, flash = kernels_for(target)
    calls = [(flash, (sds((1, T, heads, head_dim), bf16), sds((1, T, kv_heads, head_dim), bf16),
                      sds((1, T, kv_heads, head_dim), bf16)) + (sds((1,), i32),) * 4)]
    for S, Q, P in [(64, 1, 512), (1, T, 512)]:  # a decode step and a prefill chunk, 8k-token page tables
        for kv in (pages, int8_pages):
            calls.append((paged, (sds((S, Q, heads, head_dim), bf16), kv, kv, sds((S, P), i32), sds((S,), i32),
                                  sds((S, Q), i32))))
    # Triton kernels carry no serialization guarantee; lowering them is what is checked.
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for fn, args in calls:
        lowered = export.export(jax.jit(fn), platforms=[platform], disabled_checks=unchecked)(*args)
        assert "custom_call" in lowered.mlir_module()
