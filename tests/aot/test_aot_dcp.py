"""Decode context parallelism compiled deviceless at 128K (scripts/aot_check.py --decode-context-parallel-size):
each step and cache write of an engine with max_model_len 131072 over 3 chips of a v5e and of an H100 host (v6e by
hand: JAXSERVE_AOT_DCP_CHIPS="v6e:2x4"), with the HBM audit and the collectives. The audit found, and these hold
fixed: XLA:TPU's pages-minor layout of the cache relayouted by the jnp attention every layer (the cache is placed
row-major there: `jaxserve.parallel.context_parallel.pages_by_token`), the flat view of the pages that the CPU
gather reads copied whole on TPU (`jaxserve.cache.kv_cache.read_blocks`), the k/v projections' kernels gathered
(kept whole under DCP), and a reduce-scatter over 3 TPU chips that XLA:TPU cannot lower (an all-to-all instead)."""
import os

import pytest
from test_aot import aot_check

from compilers import needs_compilers  # noqa: F401

CHIPS = tuple(os.environ.get("JAXSERVE_AOT_DCP_CHIPS", "v5e:2x4 h100:8").split())


@needs_compilers
@pytest.mark.parametrize("target", CHIPS)
def test_dcp_steps_compile_at_128k_with_the_hbm_audit(tmp_path, target):
    """SmolLM2 (9 heads, 3 KV heads) at DCP 3, 4 sequences of up to 131072 tokens, two of its layers: every program
    compiles and fits; the HBM audit finds no weight- or cache-sized copy; the largest all-gather is the step's
    queries (tokens x heads x head_dim in bf16), never anything of the context's size."""
    rows = aot_check(tmp_path, "--model", "smollm2-135m@3", "--decode-context-parallel-size", "3", "--target",
                     target, "--max-model-len", "131072", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                     "--num-layers", "2", "--only-extremes")
    assert {(r["program"], r["shape"]) for r in rows} >= {("step", "1 tokens x 1 rows"),
                                                           ("step", "64 tokens x 4 rows"),
                                                           ("cache write", "64 tokens x 4 rows")}
    for r in rows:
        assert not r["error"] and r["fits"], (r["program"], r["shape"], r["error"])
        assert not r["traffic"], (r["program"], r["shape"], r["traffic"])
        tokens = int(r["shape"].split()[0])
        assert r["largest_all_gather_bytes"] <= tokens * 9 * 64 * 2, (r["program"], r["shape"])
