"""The `jaxserve` command and the drive-the-steps example, run as a user would."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from locations import ROOT

ROOT = ROOT


def run(*args, timeout=300, env=None):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("extra", [[], ["--speculative-method", "ngram", "--num-speculative-tokens", "3",
                                        "--prompt-lookup-min", "1", "--no-adaptive-speculation"]])
def test_generate_streams_the_default_model_answer(default_gguf_path, extra):
    r = run(sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "The capital of France is",
            "--max-tokens", "4", *extra)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris.")


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "unknown model"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--prompt", "hi", "--num-speculative-tokens", "2"], "--speculative-method"),
    (["generate", "--prompt", "hi", "--speculative-method", "draft_model"], "draft model"),
    (["generate", "--prompt", "hi", "--speculative-method", "ngram", "--num-speculative-tokens", "0"],
     "num_speculative_tokens"),
])
def test_user_errors_are_one_line_and_nonzero(args, message):
    r = run(sys.executable, "-m", "jaxserve.cli", *args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_corrupt_model_file_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    r = run(sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "hi", "--model", str(bad))
    assert r.returncode == 1 and "broken.gguf" in r.stderr and "Traceback" not in r.stderr


def test_help_explains_options():
    r = run(sys.executable, "-m", "jaxserve.cli", "generate", "--help")
    assert r.returncode == 0 and "--max-tokens" in r.stdout and "--temperature" in r.stdout


def test_drive_steps_example(default_gguf_path):
    r = run(sys.executable, "scripts/drive_steps.py", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


def test_an_unwritable_cache_generates_on_xla_with_one_warning(default_gguf_path, tmp_path):
    """A read-only container: the CPU kernels cannot be built into $JAXSERVE_CACHE, so XLA's own lowering runs them,
    said once (JAX's compilation cache is pointed elsewhere: its own warnings are not the kernels')."""
    from jaxserve.cpu_kernels.build import PREBUILT_DIR
    r = run(sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "The capital of France is", "--max-tokens",
            "4", "--model", str(default_gguf_path),
            env={"JAXSERVE_CACHE": "/proc/x", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris.")
    prebuilt = any(PREBUILT_DIR.glob("*.so"))  # found in the package: nothing to build, nothing to say
    assert r.stderr.count("CPU kernels off") == (0 if prebuilt else 1), r.stderr


def test_build_kernels_writes_every_variant_the_compiler_takes(tmp_path):
    """`jaxserve build-kernels`: every kernel for every variant of this architecture; a variant the compiler does
    not know (an old one) is skipped with its error, the others written."""
    from jaxserve.cpu_kernels import build, isa
    compiler = tmp_path / "cxx"
    compiler.write_text('#!/bin/sh\ncase "$*" in *x86-64-v4*|*armv8.2-a*) echo "cc1plus: error: bad value" >&2; '
                        'exit 1;; esac\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && echo library > "$2"; shift; done\n')
    compiler.chmod(0o755)
    r = run(sys.executable, "-m", "jaxserve.cli", "build-kernels", "--output", str(tmp_path / "out"),
            env={"CXX": str(compiler)})
    assert r.returncode == 0, r.stderr
    taken = [v for v in isa.variants() if "x86-64-v4" not in v.name and v.name != "armv8.2-a"]
    want = sorted(build.library_name(s, v) for s in build.sources() for v in taken)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == want
    assert sorted(Path(line.removeprefix("wrote ")).name for line in r.stdout.splitlines()) == want
    refused = len(build.sources()) * (len(isa.variants()) - len(taken))
    assert r.stderr.count("cc1plus: error: bad value") == refused, r.stderr
