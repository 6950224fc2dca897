"""The ragged GPU attention kernel (Pallas, Triton lowering) in interpret mode on CPU against the oracle
(`ragged_attention_reference` and the dense numpy one in tests/ragged.py), on fresh random ragged batches:
decode-only, prefill-only and mixed steps whose rows cross pages, query blocks and key blocks; GQA ratios 1 / 3 /
4; a sliding window; int8 pages; bfloat16. Then the kernel's lowering for a GPU with no GPU here (jax.export),
backend resolution and dispatch, the start-up check and the engine on the kernels. Small shapes throughout:
interpret mode runs every program of the grid one by one. (The TPU kernel's tests: test_pallas_kernels_tpu.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import attention, resolve_attention_backend
from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages
from jaxserve.pallas_kernels import BLOCK_SIZES, ragged_attention_gpu
from jaxserve.pallas_kernels.reference import ragged_attention_reference
from jaxserve.pallas_kernels.self_check import quantize_pages
from ragged import KINDS, expected, random_ragged_case, row_lengths

SIZES = BLOCK_SIZES["gpu-interpret"]  # 4 tokens per program, 4-key and 2-page blocks: every row crosses some


def fresh_rng():
    """New inputs every run; the seed goes into failure messages so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def run(case, *, k_pages=None, v_pages=None, window=None, dtype=jnp.float32, **sizes):
    rows = jax.tree.map(jnp.asarray, case.rows)
    k_pages = jnp.asarray(case.k_pages, dtype) if k_pages is None else k_pages
    v_pages = jnp.asarray(case.v_pages, dtype) if v_pages is None else v_pages
    args = (jnp.asarray(case.q, dtype), jnp.asarray(case.k, dtype), jnp.asarray(case.v, dtype), k_pages, v_pages,
            rows)
    got = ragged_attention_gpu(*args, sliding_window=window, interpret=True, **{**SIZES, **sizes})
    return np.asarray(got, np.float32), args


def check(got, want, seed, tol=2e-5):
    assert not np.isnan(got).any(), f"NaN in the output; seed {seed}"
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"seed {seed}")


@pytest.mark.parametrize("kind,heads,kv_heads,window", [
    ("decode", 6, 2, None), ("prefill", 4, 4, None), ("mixed", 6, 2, None), ("mixed", 8, 2, 7),
    ("prefill", 6, 2, 13)])
def test_matches_the_oracle(kind, heads, kv_heads, window):
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, kind, max_start=60), heads=heads, kv_heads=kv_heads)
    got, _ = run(case, window=window)
    check(got, expected(case, window), seed)


def test_gemma3_head_shapes():
    """Gemma 3 270M's heads (4 query heads on 1 KV head of 256) in a sliding layer: a window shorter than the rows."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=40), heads=4, kv_heads=1, head_dim=256)
    got, _ = run(case, window=13)
    check(got, expected(case, 13), seed, tol=5e-5)


def test_block_sizes_do_not_change_the_result():
    """One query block per decode row, or several per prompt chunk; 16-key blocks as on the GPU."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=60), page_size=8)
    for sizes in (dict(block_q=1, block_k=16, block_pages=1), dict(block_q=16, block_k=16, block_pages=4)):
        check(run(case, window=9, **sizes)[0], expected(case, 9), seed)


def test_int8_pages_match_the_oracle_on_the_same_pages():
    """The kernel dequantizes int8 pages as `read_pages` does: the oracle reading the same Int8Pages is the
    reference, at float tolerance."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, KINDS[rng.integers(3)], max_start=60))
    k_pages, v_pages = quantize_pages(jnp.asarray(case.k_pages)), quantize_pages(jnp.asarray(case.v_pages))
    got, args = run(case, k_pages=k_pages, v_pages=v_pages, window=11)
    check(got, np.asarray(ragged_attention_reference(*args, sliding_window=11)), seed)


def test_bfloat16():
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=60))
    got, args = run(case, dtype=jnp.bfloat16)
    want = np.asarray(ragged_attention_reference(*args), np.float32)
    check(got, want, seed, tol=3e-2)


def test_attention_dispatches_to_the_kernel():
    """The model's entry point with the interpreted GPU backend: the kernel, as `ragged_kernel_for` configures it."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, "mixed", max_start=40))
    args = (case.q, case.k, case.v, case.k_pages, case.v_pages, jax.tree.map(jnp.asarray, case.rows))
    got = np.asarray(attention(*map(jnp.asarray, args[:5]), args[5], sliding_window=5,
                               backend="pallas-gpu-interpret"))
    check(got, expected(case, 5), seed)


def test_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "reference"
    assert resolve_attention_backend("auto", "gpu") == "pallas-gpu"
    assert resolve_attention_backend("auto", "tpu") == "pallas-tpu"
    assert resolve_attention_backend("pallas", "tpu") == "pallas-tpu"
    assert resolve_attention_backend("pallas", "cpu") == "pallas-gpu-interpret"
    assert resolve_attention_backend("pallas-tpu", "cpu") == "pallas-tpu-interpret"
    assert resolve_attention_backend("reference", "gpu") == "reference"
    assert resolve_attention_backend("dense", "tpu") == "dense"  # the oracle itself, on any platform
    with pytest.raises(ValueError, match="cannot run on gpu"):
        resolve_attention_backend("pallas-tpu", "gpu")
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", "cpu")


def test_engine_with_the_pallas_backend_gives_the_reference_tokens(tmp_path):
    from hf_models import save_tiny_model
    from jaxserve import SamplingParams
    from tiny import make_llm, prompts
    save_tiny_model("mistral-sliding", tmp_path)  # GQA 2:1 and a 12-token sliding window
    ps = prompts(np.random.default_rng(), [5, 23, 40])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = make_llm(str(tmp_path))
    want = [o.outputs[0].token_ids for o in reference.generate(ps, sp, use_tqdm=False)]
    llm = make_llm(str(tmp_path), attention_backend="pallas-gpu")
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
    assert results["attention"] and all(r["max_abs_err"] < 1e-4 for r in results["attention"])
    assert results["quantized"] and all(r["int8_rel_err"] < 1e-5 and r["int4_rel_err"] < 1e-5
                                        for r in results["quantized"])


def test_start_up_check_accepts_good_kernels_and_reports_failures(monkeypatch):
    from jaxserve.pallas_kernels import self_check
    serving = dict(num_pages=40, pages_per_seq=8, max_num_seqs=4, max_tokens=32)
    assert self_check.check_kernels("pallas-gpu-interpret", 6, 2, 64, 8, jnp.float32, 5, serving) is None
    assert self_check.check_kernels("pallas-gpu-interpret", 6, 2, 64, 8, jnp.float32, None, serving,
                                    kv_cache_dtype="int8") is None

    def broken(*args, **kwargs):
        raise RuntimeError("cannot lower")
    monkeypatch.setattr(self_check, "ragged_kernel_for", lambda backend: broken)
    assert "cannot lower" in self_check.check_kernels("pallas-gpu", 6, 2, 64, 8, jnp.float32)
    wrong = lambda q, *args, **kwargs: q  # noqa: E731
    monkeypatch.setattr(self_check, "ragged_kernel_for", lambda backend: wrong)
    assert "disagrees" in self_check.check_kernels("pallas-gpu", 6, 2, 64, 8, jnp.float32)
    for plain in ("reference", "dense"):  # no kernel: nothing to check
        assert self_check.check_kernels(plain, 6, 2, 64, 8, jnp.float32) is None


def test_auto_falls_back_to_the_reference_when_the_check_fails(monkeypatch, caplog):
    from jaxserve import engine_factory
    from jaxserve.pallas_kernels import self_check
    from jaxserve.config import ModelConfig
    config = ModelConfig("LlamaForCausalLM", 320, 64, 128, 2, 4, 2, 16)
    monkeypatch.setattr(self_check, "check_kernels", lambda *a, **kw: "cannot lower")
    assert engine_factory.checked_backend("pallas-gpu", "auto", config, 16, jnp.bfloat16) == "reference"
    assert "cannot lower" in caplog.text
    with pytest.raises(RuntimeError, match="cannot lower"):
        engine_factory.checked_backend("pallas-gpu", "pallas", config, 16, jnp.bfloat16)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])  # a serving size; SmolLM2
def test_lowers_for_the_gpu(heads, kv_heads, head_dim):
    """Pallas' Triton lowering runs here without a GPU: it checks block shapes (powers of two) and ops (Triton's
    own compiler still waits for hardware). A 512-token step of 64 rows over 8k-token page tables, with the serving
    block sizes, float and int8 pages, with and without a window."""
    from jax import export
    sds, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    T, S, P, num_pages, page_size = 512, 64, 512, 1024, 16
    rows = RaggedRows(sds((T,), i32), sds((T,), i32), sds((S + 1,), i32), sds((S,), i32), sds((S, P), i32))
    pages = sds((num_pages, kv_heads, page_size, head_dim), bf16)
    int8_pages = Int8Pages(sds(pages.shape, jnp.int8), sds(pages.shape[:-1], jnp.float32))
    q, kv = sds((T, heads, head_dim), bf16), sds((T, kv_heads, head_dim), bf16)
    # Triton kernels carry no serialization guarantee; lowering them is what is checked.
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for cache in (pages, int8_pages):
        for window in (None, 512):
            def fn(q, k, v, k_pages, v_pages, rows, window=window):
                return ragged_attention_gpu(q, k, v, k_pages, v_pages, rows, sliding_window=window,
                                            **BLOCK_SIZES["gpu"])
            lowered = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)(
                q, kv, kv, cache, cache, rows)
            assert "__gpu$xla.gpu.triton" in lowered.mlir_module()
