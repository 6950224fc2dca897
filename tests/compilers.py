"""The real TPU and GPU compilers for deviceless tests: where they are, and a skip where they are not."""
import importlib.util
import sys

import pytest

from locations import ROOT


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
