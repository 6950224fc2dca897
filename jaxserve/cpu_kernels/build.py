"""Building a kernel's C++ source into a shared library on first use, cached per source, compiler and CPU.

The kernels are compiled for the machine they run on (-march=native: the widest vector instructions it has), so the
library is keyed by the CPU's model and feature flags as well as the source and the compiler: a cache directory
shared between machines (a home directory over NFS) holds one library per kind of CPU.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from jaxserve.weights.default_model import cache_dir

logger = logging.getLogger("jaxserve")

# Set to 0 to run XLA's own lowering everywhere a kernel would be used (A/B measurements, or a machine whose compiler
# misbehaves).
ENV_SWITCH = "JAXSERVE_CPU_KERNELS"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keep}))


def _flags() -> list[str]:
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-w"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # GCC's default on AVX-512 machines is 256-bit vectors
    return flags


@functools.cache
def load(source_name: str) -> ctypes.CDLL | None:
    """The library built from this package's `source_name`, or None (logged once) where it cannot be built."""
    if not enabled():
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        logger.warning("no C++ compiler (g++, clang++ or $CXX): CPU kernels off, XLA's own lowering instead")
        return None
    source = Path(__file__).with_name(source_name)
    flags = _flags() + [f"-I{jax.ffi.include_dir()}"]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("C++ compiler %s does not run (%s): CPU kernels off", compiler, e)
        return None
    texts = [p.read_text() for p in [source, *sorted(source.parent.glob("*.h"))]]  # the source and its headers
    key = hashlib.sha256("\0".join([*texts, version, *flags, _cpu_identity()]).encode()).hexdigest()
    library = cache_dir() / "cpu_kernels" / f"{source.stem}-{key[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed into place: processes that build at once never load half a file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(source), "-o", partial], capture_output=True, text=True, check=True)
            os.replace(partial, library)
        except subprocess.CalledProcessError as e:
            logger.warning("building %s failed, CPU kernels off: %s", source.name, e.stderr[-2000:])
            return None
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return ctypes.CDLL(str(library))


@functools.cache
def register(source_name: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Registers each (target, symbol) of the library built from `source_name` with XLA:CPU's FFI, once; False
    where the library cannot be built (or the kernels are switched off)."""
    library = load(source_name)
    if library is None:
        return False
    for target, symbol in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True
