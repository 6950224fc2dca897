"""The instruction sets the kernels are built for: a few fixed variants per architecture instead of -march=native,
so a library built on one machine (an image's build stage, `jaxserve build-kernels`) runs on every CPU that has its
variant's features, and the best variant the CPU has is picked at run time from /proc/cpuinfo.

x86-64-v4 is AVX-512 (one 16-lane vector of lanes16.h per register), x86-64-v3 AVX2 + FMA (two); the baselines
(x86-64, armv8-a) run anywhere and keep a CPU without either, or with no /proc/cpuinfo, on the kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import platform
from pathlib import Path

# A variant's name to use instead of the best the CPU has (measurements; one the CPU lacks is refused).
ENV_VARIANT = "JAXSERVE_CPU_KERNELS_ISA"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # in the library's file name
    flags: tuple[str, ...]  # the compiler's
    needs: frozenset[str] = frozenset()  # the CPU features (/proc/cpuinfo's names) its code may use


_X86_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86 = (
    # GCC's default on AVX-512 machines is 256-bit vectors: the kernels are written for 512. With AVX-512-BF16
    # (Intel since Cooper Lake, AMD since Zen 4), attention over bf16 pages takes two products an instruction
    # (bf16_dots.h).
    Variant("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"),
            _X86_V4 | {"avx512_bf16"}),
    Variant("x86-64-v4", ("-march=x86-64-v4", "-mprefer-vector-width=512"), _X86_V4),
    Variant("x86-64-v3", ("-march=x86-64-v3",), _X86_V3),
    Variant("x86-64", ("-march=x86-64",)),
)
_AARCH64 = (
    Variant("armv8.2-a", ("-march=armv8.2-a",), frozenset({"asimd", "atomics", "asimdrdm", "dcpop"})),
    Variant("armv8-a", ("-march=armv8-a",)),
)
_GENERIC = (Variant("generic", ()),)  # another architecture: the compiler's default target


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants for an architecture (platform.machine()'s name; default this one's), best first, the last
    running on every CPU of it."""
    machine = machine or platform.machine()
    if machine in ("x86_64", "AMD64"):
        return _X86
    if machine in ("aarch64", "arm64"):
        return _AARCH64
    return _GENERIC


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags ('flags' on x86, 'Features' on Arm); empty where /proc/cpuinfo cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# Native bfloat16 arithmetic: AVX-512's bf16 dot products or AMX's bf16 tiles. With either, XLA:CPU's bf16 steps ran
# 1.1-1.9x float32's serving throughput (BENCHMARKS.md, "bfloat16 on CPU"); without (AVX2 only), bf16 decode was
# 5-10x slower than float32, its products widened in software.
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})


def has_native_bf16(features: frozenset[str] | None = None) -> bool:
    """Whether the CPU (or these /proc/cpuinfo flags) computes bfloat16 products natively."""
    return bool(NATIVE_BF16 & (cpu_features() if features is None else features))


def supported() -> tuple[Variant, ...]:
    """The variants this CPU runs, best first ($JAXSERVE_CPU_KERNELS_ISA's alone, if set and run); never empty
    without that variable: the baseline needs nothing."""
    runs = tuple(v for v in variants() if v.needs <= cpu_features())
    chosen = os.environ.get(ENV_VARIANT)
    if chosen:
        return tuple(v for v in runs if v.name == chosen)
    return runs
