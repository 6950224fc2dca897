"""Decode context parallelism compiled deviceless at 128K (scripts/aot_check.py --decode-context-parallel-size):
each step and cache write of an engine with max_model_len 131072 over 3 H100s, with the HBM audit and the
collectives. v5e/v6e (JAXSERVE_AOT_DCP_CHIPS="v5e:2x4 h100:8") do not pass yet: XLA:TPU lays the cache's
[pages, heads, 16, 64] arrays out pages-minor, so the jnp attention's page gathers relayout every layer's cache
(the audit's 1.6 GB a step), and it cannot lower the merge's reduce over 3 devices at 64 tokens ("AllReduce fusion
with 3 sized replica_groups ... not implemented for TPU")."""
import os

import pytest

from compilers import needs_compilers  # noqa: F401
from test_aot import aot_check

CHIPS = tuple(os.environ.get("JAXSERVE_AOT_DCP_CHIPS", "h100:8").split())


@needs_compilers
@pytest.mark.parametrize("target", CHIPS)
def test_dcp_steps_compile_at_128k_with_the_hbm_audit(tmp_path, target):
    """SmolLM2 (9 heads, 3 KV heads) at DCP 3, 4 sequences of up to 131072 tokens, two of its layers: every program
    compiles and fits; no cache- or weight-sized copy beyond k/v projection slices (HBM audit under 5 MB a step,
    against a 100+ MB page array); the largest all-gather is the step's queries (tokens x heads x head_dim), never
    anything of the context's size."""
    rows = aot_check(tmp_path, "--model", "smollm2-135m@3", "--decode-context-parallel-size", "3", "--target",
                     target, "--max-model-len", "131072", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                     "--num-layers", "2", "--only-extremes")
    assert {(r["program"], r["shape"]) for r in rows} >= {("step", "1 tokens x 1 rows"),
                                                           ("step", "64 tokens x 4 rows"),
                                                           ("cache write", "64 tokens x 4 rows")}
    for r in rows:
        assert not r["error"] and r["fits"], (r["program"], r["shape"], r["error"])
        assert r["traffic_bytes"] < 5e6, (r["program"], r["shape"], r["traffic"])
        tokens = int(r["shape"].split()[0])
        assert r["largest_all_gather_bytes"] <= tokens * 9 * 64 * 4 * 3, (r["program"], r["shape"])
