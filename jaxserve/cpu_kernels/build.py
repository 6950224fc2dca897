"""Building a kernel's C++ source into a shared library, ahead of time (`jaxserve build-kernels`: every variant of
isa.py, into the package's prebuilt/ directory an image or a wheel ships) or on first use (the best variant this
CPU runs, into the cache directory), and loading it.

A library's name holds a key of everything its code depends on besides the compiler: its source and headers, the
flags, jaxlib's version and the FFI headers it was compiled against (an upgrade of jaxlib never loads a stale one).
The compiler is left out so a prebuilt library is found on a machine that has none (the binary interface is C's,
which no C++ compiler changes). A library another user could have written is never loaded (`trust`): with a cache
directory shared or writable by others, the kernels are built in a private temporary directory instead. Whatever goes
wrong (no compiler, a failed or hung build, an unwritable cache, a library that does not load) turns the kernels off
with one warning for the process: XLA's own lowering runs instead.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from jaxserve.cpu_kernels import isa
from jaxserve.cpu_kernels.trust import why_untrusted
from jaxserve.paths import cache_dir

logger = logging.getLogger("jaxserve")

# Set to 0 to run XLA's own lowering everywhere a kernel would be used (A/B measurements, or a machine whose compiler
# misbehaves).
ENV_SWITCH = "JAXSERVE_CPU_KERNELS"
SOURCE_DIR = Path(__file__).parent
PREBUILT_DIR = SOURCE_DIR / "prebuilt"  # `jaxserve build-kernels`'s default output, looked in before the cache
# A build that takes longer is stopped (a compiler hung on a network file system, a wrapper waiting for a licence):
# the kernels are off rather than the process's first step held forever. Each takes ~5 s on 2 vCPUs.
COMPILE_TIMEOUT_S = 300.0


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class FirstWarning:
    """Logs the process's first warning only: every kernel fails for the same reason, most often (no compiler, an
    unwritable cache), and each would say it again."""

    def __init__(self) -> None:
        self.given = False

    def __call__(self, message: str, *args) -> None:
        if not self.given:
            self.given = True
            logger.warning(message, *args)


kernels_off = FirstWarning()
not_private = FirstWarning()


def sources() -> list[str]:
    """The kernels' C++ sources (file names in this package)."""
    return sorted(p.name for p in SOURCE_DIR.glob("*.cc"))


def library_dirs() -> list[Path]:
    """Where a built library is looked for, in order: the package's prebuilt ones, then the cache's."""
    return [PREBUILT_DIR, cache_dir() / "cpu_kernels"]


def flags(variant: isa.Variant) -> list[str]:
    # Warnings on; -Wno-psabi because GCC notes that lanes16.h's 64-byte vectors would be passed differently with
    # AVX-512, which matters only across libraries: every function taking them is inline in one. The FFI headers are
    # jaxlib's (-isystem, with its include directory after these flags): their warnings are not ours to fix.
    return ["-O3", *variant.flags, "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-Wall", "-Wextra",
            "-Wno-psabi"]


@functools.cache
def ffi_fingerprint() -> str:
    """jaxlib's version and the FFI headers' text: what a library's binary interface to XLA depends on."""
    headers = sorted((Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api").glob("*.h"))
    return "\0".join([jaxlib.__version__, *(h.read_text() for h in headers)])


def library_name(source_name: str, variant: isa.Variant) -> str:
    source = SOURCE_DIR / source_name
    texts = [p.read_text() for p in [source, *sorted(SOURCE_DIR.glob("*.h"))]]  # the source and its headers
    key = hashlib.sha256("\0".join([*texts, *flags(variant), ffi_fingerprint()]).encode()).hexdigest()
    return f"{source.stem}-{variant.name}-{key[:16]}.so"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def compile_library(cxx: str, source_name: str, variant: isa.Variant, output: Path,
                    extra_flags: tuple[str, ...] = ()) -> Path:
    """Compiles source_name for variant into output (a file); raises OSError, CalledProcessError (its stderr
    captured) or TimeoutExpired (after COMPILE_TIMEOUT_S) where it cannot."""
    output.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: processes that build at once never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=output.parent)
    os.close(fd)
    try:
        run_compiler([cxx, *flags(variant), *extra_flags, "-isystem", jax.ffi.include_dir(),
                      str(SOURCE_DIR / source_name), "-o", partial])
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return output


def run_compiler(command: list[str]) -> None:
    """command, its output captured, within COMPILE_TIMEOUT_S. The compiler runs in a process group of its own, all
    of it ended at the timeout: g++ hands the work to cc1plus, as and ld, which would otherwise keep running (and
    keep the pipes open, so that reading them would wait for them)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as compiling:
        try:
            stdout, stderr = compiling.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.killpg(compiling.pid, signal.SIGKILL)
            compiling.communicate()
            raise
    if compiling.returncode:
        raise subprocess.CalledProcessError(compiling.returncode, command, stdout, stderr)


@dataclasses.dataclass
class Built:
    written: list[Path]  # the libraries built
    refused: list[str]  # "source variant: the compiler's error", for a variant the compiler does not take


def build_all(output_dir: Path, extra_flags: tuple[str, ...] = ()) -> Built:
    """Every kernel for every variant of this architecture (not only those this CPU runs: the libraries go to other
    machines), into output_dir, compiled side by side; RuntimeError where there is no compiler or nothing built."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, clang++ or $CXX) to build the CPU kernels with")
    jobs = [(source_name, variant) for source_name in sources() for variant in isa.variants()]

    def build(job):
        source_name, variant = job
        try:
            return compile_library(cxx, source_name, variant, output_dir / library_name(source_name, variant),
                                   extra_flags)
        except subprocess.TimeoutExpired:
            return f"{source_name} {variant.name}: no result after {COMPILE_TIMEOUT_S:.0f} s"
        except subprocess.CalledProcessError as e:
            lines = e.stderr.strip().splitlines() or [f"exit status {e.returncode}"]
            return f"{source_name} {variant.name}: {next((x for x in lines if 'error' in x), lines[-1])}"

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(build, jobs))
    built = Built([r for r in results if isinstance(r, Path)], [r for r in results if isinstance(r, str)])
    if not built.written:
        raise RuntimeError("no CPU kernel built: " + "; ".join(built.refused))
    return built


def _prebuilt(source_name: str, candidates: tuple[isa.Variant, ...]) -> Path | None:
    """The best variant's library already built (prebuilt or cached) that only this user or root could have
    written, if any (resolved: what was checked is what is loaded)."""
    for variant in candidates:
        for directory in library_dirs():
            path = directory / library_name(source_name, variant)
            if path.is_file():
                path = path.resolve()
                problem = why_untrusted(path)
                if problem is None:
                    return path
                not_private("not loading the CPU kernel %s: %s (another user could have written it)", path, problem)
    return None


@functools.cache
def private_dir() -> Path:
    """A directory of this process's own for the kernels it builds (removed at exit), where the cache is not
    private."""
    path = Path(tempfile.mkdtemp(prefix="jaxserve-cpu-kernels-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _build_dir() -> Path:
    """Where to build a library: the cache's directory, or a private one where another user could write there."""
    directory = library_dirs()[-1]
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = why_untrusted(directory)
    if problem is None:
        return directory
    not_private("not building the CPU kernels in %s: %s (chmod go-w it, or set $JAXSERVE_CACHE): building them in "
                "a private temporary directory instead, each run", directory, problem)
    directory = private_dir()
    problem = why_untrusted(directory)
    if problem is not None:
        raise OSError(f"no private directory to build in: {problem}")
    return directory


def _library(source_name: str) -> Path | None:
    """The library to load: found, or built into the cache for the best variant (None, warned, where it cannot)."""
    candidates = isa.supported()
    if not candidates:
        kernels_off("%s=%s is not a variant this CPU runs (%s): CPU kernels off", isa.ENV_VARIANT,
                    os.environ.get(isa.ENV_VARIANT), ", ".join(v.name for v in isa.variants()))
        return None
    found = _prebuilt(source_name, candidates)
    if found is not None:
        return found
    cxx = compiler()
    if cxx is None:
        kernels_off("no C++ compiler (g++, clang++ or $CXX) and no prebuilt kernel (`jaxserve build-kernels`): "
                    "CPU kernels off, XLA's own lowering instead")
        return None
    output = _build_dir() / library_name(source_name, candidates[0])
    try:
        return compile_library(cxx, source_name, candidates[0], output)
    except subprocess.CalledProcessError as e:
        kernels_off("building %s failed, CPU kernels off: %s", source_name, e.stderr[-2000:])
    except subprocess.TimeoutExpired:
        kernels_off("building %s took more than %g s (%s), CPU kernels off: XLA's own lowering instead",
                    source_name, COMPILE_TIMEOUT_S, cxx)
    return None


@functools.cache
def load(source_name: str) -> ctypes.CDLL | None:
    """The library built from this package's `source_name`, or None (one warning for the process) where it cannot
    be found, built or loaded."""
    if not enabled():
        return None
    try:
        path = _library(source_name)
        return None if path is None else ctypes.CDLL(str(path))
    except OSError as e:  # an unwritable cache, a compiler that does not run, a library that does not load
        kernels_off("CPU kernel %s unavailable (%s): CPU kernels off, XLA's own lowering instead", source_name, e)
        return None


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
