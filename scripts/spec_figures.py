"""bench_spec.py's pure parts: the coding workload's prompts, vLLM's spec-decode figures from two snapshots of
`llm.stats()`, the step costs that explain them, and the result table.

Acceptance per position is vLLM's: of all verifications (drafts), the share whose j-th proposal was accepted
(`num_accepted_tokens_per_pos[j] / num_drafts`); the mean accepted length is 1 + accepted / drafts, the tokens a
verification emits (its accepted proposals and the target's own token). An adaptive engine may ask a sequence for
fewer than k proposals, so its later positions count drafts that had none there: the figure is what the engine got,
not what the proposer could do.
"""
from __future__ import annotations

import itertools
import statistics
from pathlib import Path

# Coding tasks the EAGLE-3 and draft training prompts (train_draft.CODE_TASKS) do not contain: held out by
# construction, so the head is measured on code it was not trained on.
CODE_TASKS = [
    "Write a Python function that returns the second largest number in a list.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that groups a list of words by their first letter.",
    "Write a SQL query that finds the three customers with the most orders.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a bash script that counts the lines of every .py file in a directory.",
    "Write a Python generator that yields the prime numbers below n.",
    "Write a C function that swaps two integers through pointers.",
    "Write a Python function that parses a date like 2024-03-15 and returns the weekday.",
    "Write a JavaScript function that deep-clones a plain object.",
    "Write a Python function that rotates a list by k positions.",
    "Write a Python function that computes the running average of a list of numbers.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Java method that returns the sum of the digits of an integer.",
    "Write a Python function that finds all pairs in a list that add up to a target.",
]

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def code_prompts(n: int) -> list[list[dict]]:
    """n coding requests (chat conversations), the tasks in turn; past the list, asked again with another ending
    so that no two requests of a batch share a prompt."""
    return [[{"role": "user", "content": CODE_TASKS[i % len(CODE_TASKS)] +
              ("" if i < len(CODE_TASKS) else " Add a short docstring.")}] for i in range(n)]


def spec_delta(before, after) -> dict:
    """vLLM's spec-decode counters between two EngineStats snapshots; per position as a list (a snapshot of an
    engine without speculation has none)."""
    d = {k: getattr(after, f"spec_decode_{k}") - getattr(before, f"spec_decode_{k}") for k in COUNTERS}
    d["num_accepted_tokens_per_pos"] = [
        a - b for a, b in itertools.zip_longest(after.spec_decode_num_accepted_tokens_per_pos,
                                                before.spec_decode_num_accepted_tokens_per_pos, fillvalue=0)]
    return d


def spec_figures(d: dict) -> dict:
    """Acceptance rate, mean accepted length and acceptance per position from spec_delta's counters (None where
    nothing was verified)."""
    drafts = d["num_drafts"]
    return {"acceptance": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
            "mean_accepted_length": 1 + d["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_per_pos": [n / drafts for n in d["num_accepted_tokens_per_pos"]] if drafts else None}


def median_run(runs: list[dict]) -> dict:
    """One row from repeated runs of the same (engine, workload, batch): the median rate, every rate kept; the
    counters and texts of the first run (greedy: every run's text is the same, which `texts_agree` records)."""
    rates = [r["tok_s"] for r in runs]
    return {**runs[0], "tok_s": statistics.median(rates), "tok_s_runs": rates,
            "texts_agree": all(r["texts"] == runs[0]["texts"] for r in runs)}


def compare_to_plain(results: list[dict]) -> None:
    """Adds each row's speedup over plain at the same workload and batch, and how many of its texts equal plain
    greedy's ("same_text", "n/N")."""
    plain = {(r["workload"], r["batch"]): r for r in results if r["engine"] == "plain"}
    for r in results:
        base = plain.get((r["workload"], r["batch"]))
        r["speedup"] = r["tok_s"] / base["tok_s"] if base else None
        same = sum(a == b for a, b in zip(r["texts"], base["texts"])) if base else 0
        r["same_text"] = f"{same}/{len(r['texts'])}"


def num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown_table(results: list[dict]) -> str:
    """The result rows as a markdown table (after compare_to_plain)."""
    lines = ["| engine | workload | batch | tok/s | speedup | acceptance | mean acc. length | accepted per position "
             "| verifications / steps | same text |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per_pos = "-" if not r.get("acceptance_per_pos") else " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
        lines.append(f"| {r['engine']} | {r['workload']} | {r['batch']} | {r['tok_s']:.1f} | "
                     f"{num(r.get('speedup'))}x | {num(r.get('acceptance'))} | "
                     f"{num(r.get('mean_accepted_length'))} | {per_pos} | {r.get('num_drafts', 0)} / "
                     f"{r.get('steps', 0)} | {r['same_text']} |")
    return "\n".join(lines)


def step_cost_ratios(target_times: dict, head_times: dict, token_buckets: tuple[int, ...], k: int) -> list[dict]:
    """Per token bucket T: the head's step against the target's plain step of T tokens, and the target's
    verification of T rows of k proposals against its plain step (the warm-up timings, keyed (tokens, scored per
    row)). A speculative round of one row costs the verification, the head's catch-up of about two tokens and
    k - 1 further head steps, so (verify + head(2) + (k - 1) head(1)) / plain(1) is what a round costs in plain
    steps, against the mean accepted length it emits."""
    rows = []
    for t in token_buckets:
        plain = target_times.get((t, 1))
        head = head_times.get((t, 1))
        verify_bucket = min((b for b in token_buckets if b >= t * (k + 1)), default=None)
        verify = target_times.get((verify_bucket, k + 1)) if verify_bucket else None
        rows.append({"tokens": t, "target_s": plain, "head_s": head,
                     "head_over_target": head / plain if head and plain else None,
                     "verify_rows": t, "verify_s": verify, "verify_over_plain": verify / plain
                     if verify and plain else None})
    return rows


def train_command(python: str, scripts: Path, head_dir: str, extra: list[str]) -> list[str]:
    """The command that trains a head into head_dir (scripts/train_eagle3.py, its features cached beside it)."""
    return [python, str(scripts / "train_eagle3.py"), "--out", head_dir,
            "--work-dir", str(Path(head_dir).with_name(Path(head_dir).name + "-work")), *extra]
