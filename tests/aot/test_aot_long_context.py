"""128K tokens deviceless (issue 49, item 5): the ragged attention kernels at max_model_len 131072 (page tables of
8192 pages of 16 tokens, 64 rows) compile for v5e, v6e and an H100 with the real compilers, so their scalar memory
(SMEM), VMEM and shared memory fit; the HBM audit finds no copy of the KV cache; and nothing they hold grows with
the context: their temporaries at 128K are within a page table's size of those at 2K. (The TPU kernel took the page
table as a scalar prefetch: 2 MiB of SMEM at this shape, over v5e's and v6e's 1 MiB; the GPU kernel gathered a
[slots, 8192] table per call.) The kernels alone (`aot_check.py --kernel-only`): the steps around them take minutes
a chip to compile, and the table reaches nothing else of a step."""
import pytest
from test_aot import aot_check

from jaxserve.aot import deviceless as aot

from compilers import needs_compilers

LONG, SHORT = 131072, 2048
SHAPES = {"1 tokens x 1 rows", "64 tokens x 64 rows", "512 tokens x 64 rows"}  # --only-extremes of 64 x 512


def kernels(tmp_path, target, max_model_len, *models) -> dict:
    """(model, shape) -> the kernel's row, compiled at max_model_len for 64 sequences and 512-token steps."""
    tmp_path = tmp_path / str(max_model_len)
    tmp_path.mkdir()
    rows = aot_check(tmp_path, *(a for m in models for a in ("--model", m)), "--target", target, "--kernel-only",
                     "--only-extremes", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
                     "--max-model-len", str(max_model_len), "--num-layers", "1")
    return {(r["model"], r["shape"]): r for r in rows}


@needs_compilers
@pytest.mark.parametrize("target", [t for t in aot.TARGETS if not t.startswith("h200")])  # as an H100
def test_ragged_kernels_compile_at_128k_context(tmp_path, target):
    """SmolLM2's heads (3 KV heads of 64: 128-lane pages on TPU) and Llama 3 8B's (8 of 128, its native 128K)."""
    long = kernels(tmp_path, target, LONG, "smollm2-135m", "llama-3-8b")
    assert {s for _, s in long} == SHAPES
    for (model, shape), r in long.items():
        assert r["program"] == "ragged attention" and not r["error"], (model, shape, r["error"])
        assert r["fits"] and not r["traffic"], (model, shape, r["traffic"])
    short = kernels(tmp_path, target, SHORT, "smollm2-135m")
    table = 64 * (LONG // 16) * 4  # the page table at 128K, [64, 8192] int32: 2 MiB
    for (model, shape), r in short.items():
        # Any copy of the table (a per-block gather) or of context-sized KV would be at least this much more. (XLA
        # itself moves the table into TPU VMEM whole before the call, as it does any operand small enough: not HBM.)
        grew = long[model, shape]["temp_bytes"] - r["temp_bytes"]
        assert grew < table, (shape, long[model, shape]["temp_bytes"], r["temp_bytes"])
