"""Deviceless AOT: the real TPU (libtpu, Mosaic) and GPU (XLA:GPU, Triton) compilers compile the default model's
step programs and the ragged attention kernels at serving shapes, on this CPU-only machine (scripts/aot_check.py),
and every family's steps for a v5e and an H100 (v6e and H200 by hand: CHIPS), alone and over a mesh of
compile-only chips, with their collectives and HBM traffic checked."""
import json
import os
import subprocess

import pytest

from jaxserve.aot import deviceless as aot

from compilers import PYTHON, compilers_python, needs_compilers  # noqa: F401
from locations import ROOT


def aot_check(tmp_path, *args, allow_collective_problems: bool = False) -> list[dict]:
    """Runs scripts/aot_check.py in its own process (the GPU compiler needs its environment before jax starts).
    allow_collective_problems: return the rows when every program compiled, even if the script failed the
    collectives check (for the test to look at them)."""
    out = tmp_path / "aot.json"
    r = subprocess.run([PYTHON, "scripts/aot_check.py", *args, "--out", str(out)], capture_output=True, text=True,
                       timeout=1800, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    ok = r.returncode == 0 or (allow_collective_problems and rows and not any(x["error"] for x in rows))
    assert ok, "\n".join(f"{x['target']} {x['program']} {x['shape']}: {x['error']}" for x in rows
                          if x["error"]) or r.stderr[-3000:]
    return rows


@needs_compilers
def test_default_model_serving_programs_compile_for_tpu_and_gpu(tmp_path):
    """The engine's default shape (64 sequences, 512-token steps): the smallest step, the largest all-decode one and
    the largest, their cache writes and the ragged attention kernel, for a v5e and an H100. Two of the 30 layers:
    every layer compiles to the same program (scripts/aot_check.py without --num-layers compiles them all)."""
    rows = aot_check(tmp_path, "--model", "smollm2-135m", "--target", "v5e:2x2", "--target", "h100",
                     "--only-extremes", "--num-speculative-tokens", "4", "--num-layers", "2")
    for target in ("v5e:2x2", "h100"):
        programs = {(r["program"], r["shape"]) for r in rows if r["target"] == target}
        assert {("step", "1 tokens x 1 rows"), ("step", "64 tokens x 64 rows"), ("step", "512 tokens x 64 rows"),
                ("cache write", "512 tokens x 64 rows"), ("ragged attention", "512 tokens x 64 rows"),
                ("verify step", "64 tokens x 64 rows")} <= programs
    assert all(r["fits"] and r["peak_bytes"] > r["weight_bytes"] for r in rows if r["program"] == "step")
    decode = next(r for r in rows if r["target"] == "v5e:2x2" and r["shape"] == "64 tokens x 64 rows"
                  and r["program"] == "step")
    # ~2 flops per (bf16, 2-byte) weight per row, the tied embedding included: it is the LM head too
    assert decode["flops"] > 0.9 * 64 * decode["weight_bytes"] and decode["roofline_tokens_per_s"] > 0


@needs_compilers
def test_int8_kv_cache_kernels_compile_for_tpu_and_gpu(tmp_path):
    rows = aot_check(tmp_path, "--model", "smollm2-135m", "--target", "v5e:2x2", "--target", "h100",
                     "--kv-cache-dtype", "int8", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256", "--only-extremes", "--num-layers", "2")
    assert {r["target"] for r in rows if r["program"] == "ragged attention"} == {"v5e:2x2", "h100"}


def test_the_default_model_preset_is_the_default_model(default_llm):
    """aot's weightless smollm2-135m shape is the config the default model loads with."""
    assert default_llm.config == aot.MODEL_CONFIGS["smollm2-135m"]


# Every family's shape compiled for every chip at TP 1 and at the tensor-parallel size that leaves one KV head per
# chip (KV heads repeated where the size exceeds them: jaxserve.aot.deviceless.tensor_parallel_config), read by the
# compile, tensor-parallel and HBM audit tests below: one aot_check process per chip (and quantization) compiles every
# case once. Two of each model's layers (every layer compiles to the same program; Gemma keeps a global one), a
# 16-sequence engine of 16-token steps (--only-extremes: the 1-token step and the 16 x 16 one, with their cache
# writes and the kernel alone; a 16 x 16 step is the ragged program a 64-token one is, smaller, and the attention
# kernel's larger blocks are tests/pallas_kernels/test_pallas_kernels.py's), and 32768-token sequences, so each device's
# cache (32769 pages: 134 MB a page array for SmolLM2's one KV head a chip at TP 3) is serving-sized, larger than VMEM:
# XLA:TPU prefetches a page array small enough for VMEM into it whole (8193 pages at TP 3, 33.6 MB; 1025 pages at
# TP 1), which the audit would count as a copy. A case is (model, tensor-parallel size, quantization): a new one, e.g.
# ("llama-3-8b", 1, "int4"), is one more entry (compiled in its quantization's process, audited if its model is).
# One TPU and one GPU generation in CI (each chip's process costs 6-8 minutes of this machine's CPU); v6e:2x4 and
# h200:8 compile the same cases by hand: JAXSERVE_AOT_CHIPS="v6e:2x4 h200:8" python -m pytest tests/aot/test_aot.py
CHIPS = tuple(os.environ.get("JAXSERVE_AOT_CHIPS", "v5e:2x4 h100:8").split())  # eight chips each: every size below
ONE_KV_HEAD_PER_CHIP = {"smollm2-135m": 3, "llama-3-8b": 8, "qwen3-8b": 8, "gemma-3-1b": 4, "gemma-3-12b": 8}
CASES = [(model, tp, None) for model, one in ONE_KV_HEAD_PER_CHIP.items() for tp in (1, one)]
STEP_SHAPES = {"1 tokens x 1 rows", "16 tokens x 16 rows"}


@pytest.fixture(scope="module")
def chip_rows(tmp_path_factory):
    """chip -> every case's rows (compiled once for all the tests below)."""
    rows = {}

    def get(chip):
        if chip not in rows:
            rows[chip] = []
            for quantization in dict.fromkeys(q for _, _, q in CASES):
                models = [a for m, tp, q in CASES if q == quantization for a in ("--model", f"{m}@{tp}")]
                rows[chip] += [{**r, "quantization": quantization} for r in aot_check(
                    tmp_path_factory.mktemp("chip"), *models, "--target", chip, "--num-layers", "2",
                    "--only-extremes", "--max-num-seqs", "16", "--max-num-batched-tokens", "16",
                    "--max-model-len", "32768", *(("--quantization", quantization) if quantization else ()),
                    allow_collective_problems=True)]
        return rows[chip]
    return get


def case_rows(rows, model, tp, quantization=None) -> list[dict]:
    return [r for r in rows if (r["model"], r["tp"], r["quantization"]) == (model, tp, quantization)]


@needs_compilers
@pytest.mark.parametrize("chip", CHIPS)
def test_every_family_serving_steps_compile(chip_rows, chip):
    """Llama (3 KV heads of 64, 8 of 128), Qwen3 (8 of 128, QK-norm) and Gemma 3 (1 and 8 KV heads of 256, sliding
    and global layers) at TP 1 and at one KV head per chip: each step, its cache write and the kernel alone compile
    and fit the chip (each device its share of the weights and pages)."""
    rows = chip_rows(chip)
    for model, tp, quantization in CASES:
        case = case_rows(rows, model, tp, quantization)
        programs = {(r["program"], r["shape"]) for r in case}
        assert {(p, s) for p in ("step", "cache write") for s in STEP_SHAPES} <= programs, (model, tp, programs)
        assert ("ragged attention", "16 tokens x 16 rows") in programs
        for r in case:
            assert r["fits"] and not r["error"], (model, tp, r["program"], r["shape"], r["error"])
            if r["program"] == "step":
                assert r["argument_bytes"] < r["weight_bytes"] / tp * 1.5 + r["num_pages"] * 2 ** 20


@needs_compilers
@pytest.mark.parametrize("chip", CHIPS)
def test_tensor_parallel_steps_reduce_over_the_mesh(chip_rows, chip):
    """Over the mesh each step reduces its activations (an all-reduce per row-parallel layer and one for the
    vocab-split embedding) and a cache write is local."""
    for model, tp, quantization in CASES:
        for r in case_rows(chip_rows(chip), model, tp, quantization):
            if tp > 1 and r["program"] == "step":
                assert r["tensor_parallel_size"] == tp and r["collectives"]["all-reduce"] >= 2 * 2 + 1, (model, r)
            if tp > 1 and r["program"] == "cache write":
                assert r["tensor_parallel_size"] == tp and r["collectives"] == {}, (model, r)


@needs_compilers
@pytest.mark.parametrize("chip", CHIPS)
def test_tensor_parallel_collectives_are_the_expected_ones(chip_rows, chip):
    """An all-reduce of the activations after each row-parallel layer and after the embedding, and small per-row
    sampling values (each device samples its own slice of the vocabulary: jaxserve.parallel.mesh.sample_over_vocab):
    no logits, weight or cache array moves between devices, for any family. (XLA:GPU gathered the [1, vocab] logits
    twice in the 1-token step, and the whole 1 GB embedding table there, until sampling and the lookup became
    explicitly vocab-parallel.)"""
    from jaxserve.sampling_params import MAX_LOGPROBS
    rows = chip_rows(chip)
    problems = [f"{r['model']}@{r['tp']} {r['quantization'] or ''} {r['program']} {r['shape']}: {p}" for r in rows
                for p in r.get("collective_problems", [])]
    assert not problems, "\n".join(problems)
    for model, tp, quantization in CASES:
        if tp > 1:
            decode = next(r for r in case_rows(rows, model, tp, quantization)
                          if r["program"] == "step" and r["shape"] == "16 tokens x 16 rows")
            # The largest: each device's top MAX_LOGPROBS of 16 rows, gathered for top_logprobs (not 16 x V logits).
            assert 0 < decode["largest_all_gather_bytes"] <= 16 * tp * MAX_LOGPROBS * 4, (model, tp)


def test_tensor_parallel_config_is_the_repeated_kv_heads_one():
    """The abstract params of a tensor-parallel config wider than its KV heads are those `repeat_kv_heads` makes."""
    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.model.decoder import repeat_kv_heads
    config = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=8, num_kv_heads=2, head_dim=4, rope_theta=10000.0, max_position_embeddings=64)
    assert aot.tensor_parallel_config(config, 2) == config
    wide = aot.tensor_parallel_config(config, 8)
    assert wide.num_kv_heads == 8
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), aot.abstract_params(config, jnp.float32))
    repeated_config, repeated = repeat_kv_heads(config, params, 4)
    assert repeated_config == wide
    assert jax.tree.map(lambda x: (x.shape, x.dtype), aot.abstract_params(wide, jnp.float32)) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), repeated)
    with pytest.raises(ValueError):
        aot.tensor_parallel_config(config, 3)


# The HBM audit (jaxserve.aot.hbm_audit): no program relayouts, copies, transposes or widens the KV cache or a weight
# (what it must move is each weight read once by its dot, the pages the kernel reads, the new K/V written in place),
# for the default model, Llama 3 8B and Gemma 3 1B at TP 1 and at one KV head per chip (3, 8 and 4), on every chip,
# from the cases' rows above.
AUDITED_MODELS = ("smollm2-135m", "llama-3-8b", "gemma-3-1b")
AUDITED = [(*case, chip) for case in CASES if case[0] in AUDITED_MODELS for chip in CHIPS]


def extra_traffic(rows, *, cache: bool) -> list[str]:
    """The audit's findings of the cache (or of the weights) in these rows, one line each."""
    return [f"{r['program']} {r['shape']}: {t['kind']} of {t['of']}: {t['instruction']} "
            f"({t['array']['dtype']}[{','.join(map(str, t['array']['dims']))}]{{{t['array']['layout']}}}"
            + (f" <- {t['source']}" if t['source'] else "") + ")"
            for r in rows for t in r["traffic"] if (t["of"] == "KV cache pages") == cache]


@needs_compilers
@pytest.mark.parametrize("model, tp, quantization, chip", AUDITED)
def test_no_program_copies_the_kv_cache(chip_rows, model, tp, quantization, chip):
    """Every program reads the pages in place: the TPU kernel DMAs head-major pages of 128 lanes (before, SmolLM2's
    token-major [pages, 16, 3, 64] arrays were relaid out whole around every kernel call and cache write)."""
    rows = case_rows(chip_rows(chip), model, tp, quantization)
    assert rows and not any(r["error"] for r in rows)
    found = extra_traffic(rows, cache=True)
    assert not found, "\n".join(found)


@needs_compilers
@pytest.mark.parametrize("model, tp, quantization, chip", AUDITED)
def test_no_program_copies_a_weight(chip_rows, model, tp, quantization, chip):
    """Each weight read once by its dot, the embedding table a row per token: on TPU SmolLM2's [49152, 576] table
    (and its [16384, 576] shard at TP 3) is placed row-major and kept out of VMEM (jaxserve.parallel.layouts); before,
    the TPU default's column-major table was relaid out whole (56.6 MB) by every multi-token step's lookup."""
    found = extra_traffic(case_rows(chip_rows(chip), model, tp, quantization), cache=False)
    assert not found, "\n".join(found)


@needs_compilers
def test_int4_weights_are_read_as_int4_on_tpu_and_gpu(tmp_path):
    """int4 linear layers go through the Pallas int4 matmul inside the step programs on v5e and H100, which unpacks
    a block at a time in VMEM / registers: no step writes a float (or unpacked) copy of a weight. (XLA's
    dequantize-then-dot wrote one of every weight, every step: on H100 a bf16 copy, on v5e float32, 7.85 GB in
    Llama 3 8B's 2-layer 1-token step.) The default model's awkward widths (576 = 4.5 x 128 lanes), 2 layers. What
    may remain on v5e: in the 1-token step, down_proj's packed bytes relaid out on their way into VMEM (its u8
    [768, 576] is column-major by TPU's default layout; the kernel reads it whole either way, so no extra HBM
    pass)."""
    rows = aot_check(tmp_path, "--model", "smollm2-135m", "--target", "v5e:2x2", "--target", "h100",
                     "--num-layers", "2", "--only-extremes", "--max-num-seqs", "16", "--max-num-batched-tokens", "16",
                     "--max-model-len", "8192", "--quantization", "int4")
    assert {r["target"] for r in rows if r["program"] == "step"} == {"v5e:2x2", "h100"}
    widened = [f"{r['target']} {r['program']} {r['shape']}: {t['kind']} of {t['of']}: {t['instruction']}"
               for r in rows for t in r["traffic"]
               if t["of"] != "KV cache pages"
               and (t["array"]["dtype"] != "u8" or t["kind"] != "relayout")]
    assert not widened, "\n".join(widened)
    assert not any(r["traffic"] for r in rows if r["target"] == "h100")
