"""Deviceless AOT: the real TPU (libtpu, Mosaic) and GPU (XLA:GPU, Triton) compilers compile the default model's
step programs and the ragged attention kernels at serving shapes, on this CPU-only machine (scripts/aot_check.py)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import aot

ROOT = Path(__file__).parent.parent


def compilers_python() -> str | None:
    """A Python with libtpu and the CUDA plugin: scripts/aot_env.sh's .aot-venv (they stay out of the project's own
    environment, where the CUDA plugin writes warnings into every process's stderr), or this one if it has them."""
    venv = ROOT / ".aot-venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    try:
        found = importlib.util.find_spec("libtpu") and importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ModuleNotFoundError:
        found = None
    return sys.executable if found else None


PYTHON = compilers_python()
needs_compilers = pytest.mark.skipif(PYTHON is None, reason="the TPU and GPU compilers are not installed: "
                                                            "bash scripts/aot_env.sh")


def aot_check(tmp_path, *args) -> list[dict]:
    """Runs scripts/aot_check.py in its own process (the GPU compiler needs its environment before jax starts)."""
    out = tmp_path / "aot.json"
    r = subprocess.run([PYTHON, "scripts/aot_check.py", *args, "--out", str(out)], capture_output=True, text=True,
                       timeout=900, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    assert r.returncode == 0, "\n".join(f"{x['target']} {x['program']} {x['shape']}: {x['error']}" for x in rows
                                        if x["error"]) or r.stderr[-3000:]
    return rows


@needs_compilers
def test_default_model_serving_programs_compile_for_tpu_and_gpu(tmp_path):
    """The engine's default shape (64 sequences, 512-token steps): the smallest step, the largest all-decode one and
    the largest, their cache writes and the ragged attention kernel, for a v5e and an H100."""
    rows = aot_check(tmp_path, "--model", "smollm2-135m", "--target", "v5e:2x2", "--target", "h100",
                     "--only-extremes", "--num-speculative-tokens", "4")
    for target in ("v5e:2x2", "h100"):
        programs = {(r["program"], r["shape"]) for r in rows if r["target"] == target}
        assert {("step", "1 tokens x 1 rows"), ("step", "64 tokens x 64 rows"), ("step", "512 tokens x 64 rows"),
                ("cache write", "512 tokens x 64 rows"), ("ragged attention", "512 tokens x 64 rows"),
                ("verify step", "64 tokens x 64 rows")} <= programs
    assert all(r["fits"] and r["peak_bytes"] > r["weight_bytes"] for r in rows if r["program"] == "step")
    decode = next(r for r in rows if r["target"] == "v5e:2x2" and r["shape"] == "64 tokens x 64 rows"
                  and r["program"] == "step")
    assert decode["flops"] > 2 * 64 * 100e6 and decode["roofline_tokens_per_s"] > 0  # ~2 flops per weight per row


@needs_compilers
def test_int8_kv_cache_kernels_compile_for_tpu_and_gpu(tmp_path):
    rows = aot_check(tmp_path, "--model", "smollm2-135m", "--target", "v5e:2x2", "--target", "h100",
                     "--kv-cache-dtype", "int8", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                     "--max-model-len", "256", "--only-extremes")
    assert {r["target"] for r in rows if r["program"] == "ragged attention"} == {"v5e:2x2", "h100"}


def test_the_default_model_preset_is_the_default_model(default_llm):
    """aot's weightless smollm2-135m shape is the config the default model loads with."""
    assert default_llm.config == aot.MODEL_CONFIGS["smollm2-135m"]
