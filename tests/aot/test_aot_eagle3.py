"""An EAGLE-3 head's programs compiled deviceless (scripts/aot_check.py --speculative eagle3): Llama 3.1 8B with its
public head's shapes (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: hidden 4096, a 32000-token draft vocabulary, 3 captured
layers), alone and at TP 8, on a v5e and an H100 host (v6e and H200 by hand: JAXSERVE_AOT_EAGLE3_CHIPS="v6e:2x4
h200:8"): the target's steps that capture the head's features, the head's step and cache write, with the HBM audit and
the collectives. The check found, and this holds fixed: the head's scatter of its draft logits into the target's
vocabulary left to the partitioner, which exchanged the [draft vocabulary] index vector by an all-reduce (or gather)
every step (`jaxserve.runner.head_steps.target_logits` scatters each device's own slice instead)."""
import os

import pytest
from test_aot import aot_check

from compilers import needs_compilers  # noqa: F401

CHIPS = tuple(os.environ.get("JAXSERVE_AOT_EAGLE3_CHIPS", "v5e:2x4 h100:8").split())
FEATURES = 3 * 4096  # the captured layers' hidden states, a token
DRAFT_VOCAB = 32000


@needs_compilers
@pytest.mark.parametrize("target", CHIPS)
def test_eagle3_head_programs_compile_with_the_hbm_audit(tmp_path, target):
    """Two of the target's layers (the head reads the inputs of layers 0, 1 and 2 then), 16 sequences of up to 32768
    tokens (each page array larger than VMEM, as test_aot.py's), the 1-token and 16 x 16 steps: every program
    compiles and fits; nothing weight- or cache-sized is copied; the target's steps carry the features (every
    cached token's, by slot); over 8 chips the only collectives beyond the target's kind are the head's one gather
    of its rows' draft logits (script-checked), never the target vocabulary's logits."""
    rows = aot_check(tmp_path, "--model", "llama-3-8b", "--model", "llama-3-8b@8", "--speculative", "eagle3",
                     "--target", target, "--num-layers", "2", "--only-extremes", "--max-num-seqs", "16",
                     "--max-num-batched-tokens", "16", "--max-model-len", "32768")
    for tp in (1, 8):
        case = [r for r in rows if r["tp"] == tp]
        programs = {(r["program"], r["shape"]) for r in case}
        assert {(p, s) for p in ("step", "cache write", "head step", "head cache write")
                for s in ("1 tokens x 1 rows", "16 tokens x 16 rows")} <= programs, (tp, programs)
        for r in case:
            assert not r["error"] and r["fits"], (tp, r["program"], r["shape"], r["error"])
            assert not r["traffic"], (tp, r["program"], r["shape"], r["traffic"])
            if r["program"] in ("step", "head step"):  # the features: [pages x 16, 3 x 4096] bf16, split by column
                assert r["argument_bytes"] > r["num_pages"] * 16 * FEATURES * 2 // tp, (tp, r["program"], r["shape"])
        for r in case:
            if tp > 1 and r["program"] == "head step":
                rows_ = int(r["shape"].split()[3])
                assert r["largest_all_gather_bytes"] <= rows_ * DRAFT_VOCAB * 4, (r["shape"], r["collective_ops"])
                assert not any("32000]" in op and "s32" in op for op in r["collective_ops"]), r["collective_ops"]
