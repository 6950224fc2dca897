"""Where jaxserve keeps what it fetches and builds (model files, compiled programs, CPU kernels): one directory,
$JAXSERVE_CACHE or ~/.cache/jaxserve. A leaf: every layer may ask it, it imports nothing of jaxserve."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "JAXSERVE_CACHE"


def cache_dir() -> Path:
    """The cache directory, read at each call (tests and users point it elsewhere while the process runs)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxserve")
