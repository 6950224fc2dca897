"""scripts/roofline.py's arithmetic: a ceiling is rows over the bytes a step moves per chip, tensor parallelism
splits those bytes, and no published peer beats the ceiling of its own slice."""
import sys

import pytest

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import roofline  # noqa: E402


def test_tensor_parallelism_splits_the_bytes_and_multiplies_the_ceiling():
    one = roofline.ceiling("llama-3-8b", None, "v6e", 16, 1024)
    four = roofline.ceiling("llama-3-8b", None, "v6e", 16, 1024, chips=4)
    assert one.bound == four.bound == "memory"
    assert four.bytes == pytest.approx(one.bytes / 4) and four.tokens_per_s == pytest.approx(4 * one.tokens_per_s)
    assert one.tokens_per_s == pytest.approx(16 * 1640e9 / one.bytes)
    # int8 weights move fewer bytes than bf16 ones; a longer context more KV
    assert roofline.ceiling("llama-3-8b", "int8", "v6e", 16, 1024).bytes < one.bytes
    assert roofline.ceiling("llama-3-8b", None, "v6e", 16, 8192).bytes > one.bytes


def test_every_peer_is_below_its_own_ceiling():
    for p in roofline.PEERS:
        c = roofline.ceiling(p.model, p.quantization, p.chip, p.rows, p.context, chips=p.chips,
                             kv_cache_dtype=p.kv_cache_dtype)
        assert 0.05 < p.tokens_per_s / c.tokens_per_s < 1, p
