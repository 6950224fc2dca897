"""scripts/spec_figures.py (bench_spec.py's pure parts): vLLM's spec-decode figures from two stats snapshots, the
comparison with plain greedy, the step-cost ratios, the coding prompts and bench_spec's engine list."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import bench_spec  # noqa: E402
import spec_figures as sf  # noqa: E402
import train_draft  # noqa: E402


def stats(drafts, draft_tokens, accepted, per_pos):
    return SimpleNamespace(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                           spec_decode_num_accepted_tokens=accepted,
                           spec_decode_num_accepted_tokens_per_pos=tuple(per_pos))


def test_figures_are_vllms_from_the_counters_between_two_snapshots():
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 6))
    # Verifications of k proposals, each accepting a prefix: position j accepted iff accepted >= j + 1.
    accepted = rng.integers(0, k + 1, int(rng.integers(1, 50)))
    per_pos = [int((accepted > j).sum()) for j in range(k)]
    base = rng.integers(0, 100, k + 3)
    before = stats(*base[:3], base[3:])
    after = stats(base[0] + len(accepted), base[1] + k * len(accepted), base[2] + accepted.sum(), base[3:] + per_pos)
    d = sf.spec_delta(before, after)
    assert d["num_accepted_tokens_per_pos"] == per_pos, seed
    f = sf.spec_figures(d)
    assert f["mean_accepted_length"] == pytest.approx(1 + accepted.mean()), seed
    assert f["acceptance"] == pytest.approx(accepted.mean() / k), seed
    # Per position: the share of drafts accepted there; non-increasing, and they sum to the mean accepted - 1.
    assert f["acceptance_per_pos"] == pytest.approx([(accepted > j).mean() for j in range(k)]), seed
    assert all(a >= b for a, b in zip(f["acceptance_per_pos"], f["acceptance_per_pos"][1:])), seed
    assert sum(f["acceptance_per_pos"]) == pytest.approx(f["mean_accepted_length"] - 1), seed


def test_no_verifications_give_no_figures_and_a_plain_engine_has_no_positions():
    d = sf.spec_delta(stats(0, 0, 0, ()), stats(0, 0, 0, ()))
    assert d["num_accepted_tokens_per_pos"] == []
    assert sf.spec_figures(d) == {"acceptance": None, "mean_accepted_length": None, "acceptance_per_pos": None}
    # A snapshot taken before the first verification may still carry zeros: the lists line up.
    assert sf.spec_delta(stats(0, 0, 0, ()), stats(2, 6, 3, (2, 1, 0)))["num_accepted_tokens_per_pos"] == [2, 1, 0]


def test_rows_compare_with_plain_greedy_at_the_same_workload_and_batch():
    rows = [{"engine": "plain", "workload": "chat", "batch": 1, "tok_s": 50.0, "texts": ["a", "b"]},
            {"engine": "eagle3", "workload": "chat", "batch": 1, "tok_s": 75.0, "texts": ["a", "c"],
             "acceptance": 0.5, "mean_accepted_length": 2.5, "acceptance_per_pos": [0.8, 0.5, 0.2],
             "num_drafts": 10, "steps": 12},
            {"engine": "eagle3", "workload": "code", "batch": 1, "tok_s": 60.0, "texts": ["x"]}]
    sf.compare_to_plain(rows)
    assert rows[1]["speedup"] == 1.5 and rows[1]["same_text"] == "1/2"
    assert rows[2]["speedup"] is None and rows[2]["same_text"] == "0/1"
    table = sf.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(line.count("|") == 11 for line in table)
    assert "| eagle3 | chat | 1 | 75.0 | 1.50x | 0.50 | 2.50 | 0.80 / 0.50 / 0.20 | 10 / 12 | 1/2 |" in table


def test_median_run_keeps_every_rate_and_says_whether_the_texts_agree():
    runs = [{"tok_s": t, "texts": ["a"]} for t in (3.0, 1.0, 2.0)]
    row = sf.median_run(runs)
    assert row["tok_s"] == 2.0 and row["tok_s_runs"] == [3.0, 1.0, 2.0] and row["texts_agree"]
    assert not sf.median_run(runs + [{"tok_s": 1.0, "texts": ["b"]}])["texts_agree"]


def test_step_cost_ratios_pair_each_bucket_with_its_verification():
    buckets = (1, 2, 4, 8, 16)
    target = {(t, 1): 0.01 * t for t in buckets} | {(t, 4): 0.012 * t for t in buckets if t > 1}
    head = {(t, 1): 0.002 * t for t in buckets}
    rows = {r["tokens"]: r for r in sf.step_cost_ratios(target, head, buckets, k=3)}
    assert rows[1]["head_over_target"] == pytest.approx(0.2)
    assert rows[1]["verify_s"] == target[4, 4] and rows[4]["verify_s"] == target[16, 4]
    assert rows[1]["verify_over_plain"] == pytest.approx(0.048 / 0.01)
    assert rows[8]["verify_s"] is None and rows[8]["verify_over_plain"] is None  # 32 tokens: past the buckets
    assert sf.step_cost_ratios(target, {}, buckets, 3)[0]["head_over_target"] is None


def test_code_prompts_are_distinct_and_held_out_from_the_training_prompts():
    prompts = [c[0]["content"] for c in sf.code_prompts(2 * len(sf.CODE_TASKS))]
    assert len(set(prompts)) == len(prompts)
    assert not [p for p in prompts if any(task in p for task in train_draft.CODE_TASKS)]


def test_engines_and_the_training_command():
    names = bench_spec.engines("/d", "/h", 3)
    assert names["eagle3"] == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 3, "adaptive": False}
    assert names["eagle3-adaptive"] == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 3}
    assert "eagle3" not in bench_spec.engines(None, None, 3) and "draft" not in bench_spec.engines(None, "/h", 3)
    cmd = sf.train_command("py", Path("/s"), "/heads/h", ["--steps", "5"])
    assert cmd == ["py", "/s/train_eagle3.py", "--out", "/heads/h", "--work-dir", "/heads/h-work", "--steps", "5"]
