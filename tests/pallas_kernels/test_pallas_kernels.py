"""The ragged GPU attention kernel (Pallas, Triton lowering) in interpret mode on CPU against the oracle
(`ragged_attention_reference` and the dense numpy one in tests/ragged.py), on fresh random ragged batches:
decode-only, prefill-only and mixed steps whose rows cross pages, query blocks and key blocks; GQA ratios 1 / 3 /
4; a sliding window; int8 pages; bfloat16. Then the kernel's lowering for a GPU with no GPU here (jax.export),
backend resolution and dispatch, the start-up check and the engine on the kernels. Small shapes throughout:
interpret mode runs every program of the grid one by one. (The TPU kernel's tests: test_pallas_kernels_tpu.py.)"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import Int8Pages
from jaxserve.model.attention import attention, resolve_attention_backend
from jaxserve.pallas_kernels import BLOCK_SIZES, ragged_attention_gpu, ragged_kernel_for
from jaxserve.pallas_kernels.gpu_blocks import key_splits, step_block_q
from jaxserve.pallas_kernels.ragged_attention import kernel_grid
from jaxserve.pallas_kernels.reference import ragged_attention_reference
from jaxserve.pallas_kernels.self_check import quantize_pages, small_ragged_batch

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


def pallas_grids(fn, *args):
    """The grid of every pallas_call in fn's jaxpr (nested jaxprs included)."""
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


@pytest.mark.parametrize("heads,kv_heads,window", [(6, 2, None), (8, 1, 9)])
def test_decode_only_step_runs_one_program_per_row_and_kv_head(heads, kv_heads, window):
    """A step with no more tokens than rows (every decode-only bucket): S programs per KV head and split of the
    rows' cached keys (here the interpret sizes' 16 "cores" ask for 2), the row's G query heads as one program's
    dot rows, whatever block_q prefill uses; then a mixed step of the same rows and tokens plus a prompt chunk,
    which uses block_q."""
    rng, seed = fresh_rng()
    lengths = row_lengths(rng, "decode", max_start=60)
    case = random_ragged_case(rng, lengths, heads=heads, kv_heads=kv_heads, pad_tokens=1, pad_rows=1)
    T, (S, P) = case.q.shape[0], case.rows.page_table.shape
    assert T == S
    got, args = run(case, window=window)
    check(got, expected(case, window), seed)
    fn = lambda *a: ragged_attention_gpu(*a, sliding_window=window, interpret=True, **SIZES)  # noqa: E731
    splits = key_splits(S * kv_heads, P, SIZES["block_pages"], SIZES["cores"])
    assert pallas_grids(fn, *args) == [kernel_grid(T, S, kv_heads, 1, splits)]
    assert pallas_grids(fn, *args)[0][:2] == (S, kv_heads)
    # The serving sizes pack the same way (16 / G tokens of a row per program: one, for a decode row).
    assert step_block_q(T, S, heads // kv_heads, BLOCK_SIZES["gpu"]["block_q"]) * heads // kv_heads <= 16

    mixed = random_ragged_case(rng, lengths + [(5, 21)], heads=heads, kv_heads=kv_heads)
    got, args = run(mixed, window=window)
    check(got, expected(mixed, window), seed)
    T, (S, P) = mixed.q.shape[0], mixed.rows.page_table.shape
    # Fewer programs than "cores" (12 on one KV head) split a long page table's keys here too: seed-dependent.
    splits = key_splits((T // SIZES["block_q"] + S) * kv_heads, P, SIZES["block_pages"], SIZES["cores"])
    assert pallas_grids(fn, *args) == [kernel_grid(T, S, kv_heads, SIZES["block_q"], splits)]
    assert pallas_grids(fn, *args)[0][:2] == (T // SIZES["block_q"] + S, kv_heads), f"seed {seed}"


@pytest.mark.parametrize("rows,splits", [(1, 16), (4, 5), (16, 2), (64, 1)])
def test_few_decode_rows_split_their_keys_to_fill_the_chip(rows, splits):
    """Llama 3 8B's heads (8 KV heads), 8k-token page tables of 16-token pages, the serving sizes (H100 / H200:
    132 SMs, 128-key blocks): 1 row x 8 KV heads would run 8 programs on 132 SMs; split 16 ways (each split at
    least 4 key blocks) it runs 128. 64 rows are 512 programs already: no split. Traced, not run."""
    sds, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    P = 8192 // 16
    ragged = RaggedRows(sds((rows,), i32), sds((rows,), i32), sds((rows + 1,), i32), sds((rows,), i32),
                        sds((rows, P), i32))
    pages = sds((4096, 8, 16, 128), bf16)
    fn = lambda *a: ragged_attention_gpu(*a, **BLOCK_SIZES["gpu"])  # noqa: E731
    grid = pallas_grids(fn, sds((rows, 32, 128), bf16), sds((rows, 8, 128), bf16), sds((rows, 8, 128), bf16),
                        pages, pages, ragged)
    assert grid == [kernel_grid(rows, rows, 8, 1, splits)]
    assert splits == 1 or rows * 8 * splits >= BLOCK_SIZES["gpu"]["cores"] or splits == P // (8 * 4)


@pytest.mark.parametrize("kind,heads,kv_heads,window,int8", [("decode", 8, 1, 13, True), ("mixed", 6, 2, None, False)])
def test_split_rows_match_the_oracle(kind, heads, kv_heads, window, int8):
    """Flash-decoding: 3 programs share each row's cached keys (8-key blocks), merged after. Rows of 1 to ~60
    cached keys (some shorter than one split: the later splits see no key), GQA, a window, int8 pages; in a mixed
    step a prompt chunk after a cached prefix (its causal keys in the last split)."""
    rng, seed = fresh_rng()
    lengths = [(1, 1), (3, 1), (int(rng.integers(40, 60)), 1), (int(rng.integers(9, 30)), 1)]
    case = random_ragged_case(rng, lengths + ([(17, 6)] if kind == "mixed" else []), heads=heads, kv_heads=kv_heads)
    k_pages, v_pages = (quantize_pages(jnp.asarray(x)) if int8 else None for x in (case.k_pages, case.v_pages))
    got, args = run(case, k_pages=k_pages, v_pages=v_pages, window=window, num_splits=3)
    want = ragged_attention_reference(*args, sliding_window=window) if int8 else expected(case, window)
    check(got, np.asarray(want), seed)
    sizes = {**SIZES, "num_splits": 3}
    fn = lambda *a: ragged_attention_gpu(*a, sliding_window=window, interpret=True, **sizes)  # noqa: E731
    T, S = case.q.shape[0], case.rows.page_table.shape[0]
    assert pallas_grids(fn, *args) == [kernel_grid(T, S, kv_heads, 1 if T <= S else SIZES["block_q"], 3)]


def test_int8_pages_match_the_oracle_on_the_same_pages():
    """The kernel dequantizes int8 pages as `read_pages` does: the oracle reading the same Int8Pages is the
    reference, at float tolerance."""
    rng, seed = fresh_rng()
    case = random_ragged_case(rng, row_lengths(rng, KINDS[rng.integers(3)], max_start=60))
    k_pages, v_pages = quantize_pages(jnp.asarray(case.k_pages)), quantize_pages(jnp.asarray(case.v_pages))
    got, args = run(case, k_pages=k_pages, v_pages=v_pages, window=11)
    check(got, np.asarray(ragged_attention_reference(*args, sliding_window=11)), seed)


@pytest.mark.parametrize("backend", ["pallas-gpu-interpret", "pallas-tpu-interpret"])
def test_pages_stored_wider_than_head_dim(backend):
    """Pages stored at 128 lanes for head_dim 64 (TPU's layout of SmolLM2's heads), with random values in the
    padding, float and int8: the kernel reads only the real lanes and scales by head_dim, as the oracle does."""
    rng, seed = fresh_rng()
    for int8 in (False, True):
        args = small_ragged_batch(rng, 4, 2, 64, 8, jnp.float32, int8, head_dim_multiple=128)
        assert args[3].shape[-1] == 128
        got = ragged_kernel_for(backend)(*args, sliding_window=9)
        want = ragged_attention_reference(*args, sliding_window=9)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5,
                                   err_msg=f"seed {seed}, int8 {int8}")


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
    from jaxserve import SamplingParams

    from hf_models import save_tiny_model
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
    assert results["quantized"] and all(r["int4_rel_err"] < 1e-5 for r in results["quantized"])


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
    from jaxserve.config import ModelConfig
    from jaxserve.engine import factory as engine_factory
    from jaxserve.pallas_kernels import self_check
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


# Run by the compilers' Python (the CUDA plugin's environment must be set before jax starts): each family's heads
# through Mosaic for a v5e and a v6e and through XLA:GPU and Triton for an H100 and an H200, over an 8192-page
# cache stored as each backend stores it; then the compiler's shared memory request beside `shared_memory_bytes`'s
# bound (read from the error it gives with the opt-in limit set to 1 KB).
_COMPILE_FAMILIES = r"""
import dataclasses, json, re, sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jaxserve.aot import deviceless as aot
from jaxserve.cache import init_kv_cache
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.pallas_kernels.gpu_blocks import dot_rows, gpu_blocks, shared_memory_bytes

def compile_kernel(device, heads, kv_heads, head_dim, kv_cache_dtype, window, tokens, rows):
    config = dataclasses.replace(aot.MODEL_CONFIGS["smollm2-135m"], num_heads=heads, num_kv_heads=kv_heads,
                                 head_dim=head_dim, num_layers=1, sliding_window=window)
    backend = "pallas-" + device.platform
    pages = jax.eval_shape(lambda: init_kv_cache(config, 8192, 16, jnp.bfloat16, kv_cache_dtype,
                                                 page_head_dim_multiple(backend)))[0][0]
    r = aot._compile_kernel(config, jnp.bfloat16, device, backend, pages, tokens, rows, 256)
    values = pages.values if kv_cache_dtype == "int8" else pages
    return r, values.size * values.dtype.itemsize

for target, kv_cache_dtype, window, tokens, rows in json.loads(sys.argv[1]):
    device = aot.target_devices(target)[0]
    for heads, kv_heads, head_dim in json.loads(sys.argv[2]):
        r, page_bytes = compile_kernel(device, heads, kv_heads, head_dim, kv_cache_dtype, window, tokens, rows)
        print(json.dumps(dict(target=target, shape=[heads, kv_heads, head_dim, kv_cache_dtype, window, tokens, rows],
                              error=r.error, temp_bytes=r.temp_bytes, page_bytes=page_bytes)), flush=True)
tiny = aot.CHIPS["h100"].gpu_target.replace("shared_memory_per_block_optin: 232448",
                                           "shared_memory_per_block_optin: 1024")
device = topologies.get_topology_desc("cuda", "cuda", target_config=tiny, topology="1x1x1").devices[0]
for tokens, rows in ((512, 64), (64, 64)):
    r, _ = compile_kernel(device, 4, 1, 256, "auto", None, tokens, rows)
    b = gpu_blocks(tokens, rows, 4, 256, 16, 2)
    keys = max(b.block_pages * 16, b.block_k)
    print(json.dumps(dict(requested=int(re.search(r"requested (\d+)", r.error).group(1)),
                          bound=shared_memory_bytes(keys, dot_rows(b.block_q, 4), 256, 2, b.num_stages))), flush=True)
"""


def test_every_family_compiles_for_tpu_and_gpu():
    """SmolLM2 (9/3/64), Llama 3 8B (32/8/128), Gemma 3 1B (4/1/256), a Gemma 3 27B-like 32/16/128 and Qwen3
    (40/8/128) heads: the kernel alone, compiled by Mosaic (VMEM, tile alignment of every DMA) for a v5e and a v6e
    and by XLA:GPU and Triton (shared memory and registers) for an H100 and an H200, at the largest step of a
    64-sequence engine (512 tokens: 16 tokens per program, the most shared memory) in bf16 with a sliding window
    and at its all-decode step (64 x 64) (on int8 pages on the H200), and a 4-row decode step on the H100 (its
    rows' keys split over programs: `key_splits`). On TPU the kernel reads the cache in place: its
    temporaries are below 1% of one layer's K pages at the decode step, and at the 512-token step no more than
    the step's own queries and outputs, blocked (no cache-sized copy). Then the bound the GPU block sizes are
    derived from holds the compiler's request."""
    import json
    import os
    import subprocess

    from compilers import compilers_python
    from locations import ROOT
    python = compilers_python()
    if python is None:
        pytest.skip("the TPU and GPU compilers are not installed: bash scripts/aot_env.sh")
    steps = [("v5e:2x2", "auto", 512, 512, 64), ("v6e:2x2", "auto", None, 64, 64),
             ("h100", "auto", 512, 512, 64), ("h200", "int8", None, 64, 64), ("h100", "auto", None, 4, 4)]
    families = [(9, 3, 64), (32, 8, 128), (4, 1, 256), (32, 16, 128), (40, 8, 128)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([python, "-c", _COMPILE_FAMILIES, json.dumps(steps), json.dumps(families)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    compiled, probes = lines[:-2], lines[-2:]
    assert len(compiled) == len(steps) * len(families)
    failed = [f"{x['target']} {x['shape']}: {x['error']}" for x in compiled if x["error"]]
    assert not failed, "\n".join(failed)
    for x in compiled:
        heads, _, head_dim, _, _, tokens, rows = x["shape"]
        if x["target"].startswith("v"):  # TPU
            limit = 0.01 * x["page_bytes"] if tokens == rows else 6 * tokens * heads * max(head_dim, 128) * 2
            assert x["temp_bytes"] < limit, x
    for p in probes:
        assert 0 < p["requested"] <= p["bound"], p
