"""The `jaxserve` command and the drive-the-steps example, run as a user would."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def run(*args, timeout=300):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


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
