"""dtype "auto": bfloat16 where the CPU multiplies bf16 natively, float32 on other CPUs, bfloat16 on accelerators.
The CPU's flags are faked both ways, so the test means the same on any machine."""
import logging

import jax.numpy as jnp
import pytest

import jaxserve.weights as weights
from jaxserve.cpu_kernels.isa import has_native_bf16
from jaxserve.weights import auto_dtype, resolve_dtype

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize("flags, want", [
    (AVX2, jnp.float32),  # AVX2 only: XLA:CPU widens bf16 in software (decode 5-10x slower)
    (AVX512, jnp.float32),  # AVX-512 without its bf16 extension: the same
    (AVX512 | {"avx512_bf16"}, jnp.bfloat16),  # an AMD EPYC (Zen 4) or Cooper Lake
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, jnp.bfloat16),  # a Sapphire Rapids Xeon
    (AVX2 | {"amx_bf16"}, jnp.bfloat16),
    (frozenset(), jnp.float32),  # no /proc/cpuinfo: the safe choice
])
def test_auto_on_cpu_follows_native_bf16(flags, want):
    assert has_native_bf16(flags) == (want == jnp.bfloat16)
    assert auto_dtype("cpu", flags) == want, sorted(flags)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_on_accelerators_is_bfloat16_whatever_the_host(backend):
    assert auto_dtype(backend, AVX2) == jnp.bfloat16


@pytest.mark.parametrize("flags, want, said", [
    (AVX512 | {"amx_bf16", "avx512_bf16"}, jnp.bfloat16, "bfloat16 (the CPU has amx_bf16, avx512_bf16)"),
    (AVX2, jnp.float32, "float32 (the CPU has no native bfloat16"),
])
def test_resolve_auto_reads_the_cpu_and_says_what_it_chose(monkeypatch, caplog, flags, want, said):
    monkeypatch.setattr(weights.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(weights, "cpu_features", lambda: flags)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        assert resolve_dtype("auto") == want
    assert [r.getMessage() for r in caplog.records] == [f"dtype auto: {said}" + ("" if want == jnp.bfloat16 else
                                                                                    " (no avx512_bf16, amx_bf16))")]


def test_a_named_dtype_is_kept_on_any_cpu(monkeypatch):
    monkeypatch.setattr(weights, "cpu_features", lambda: AVX512 | {"amx_bf16"})
    assert resolve_dtype("float32") == jnp.float32  # what the tests comparing with HF name
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")
