"""lm-evaluation-harness as a real client: its `local-completions` model against `jaxserve serve` (its remote
tokenizer through /tokenize and /tokenizer_info) runs a tiny local multiple-choice task (loglikelihoods: token-id
prompts with echo, logprobs 1, max_tokens 1) and a greedy generate_until task, and every document's result equals
lm-eval's own `hf` backend on the same weights (HF transformers, float32, from the same GGUF), recorded by
scripts/record_lm_eval_references.py into tests/data/lm_eval_hf.json (HF's evaluation, with its reading of the GGUF's
tokenizer, was half of this test's time)."""
import json
import logging

import pytest

from locations import DATA

TASKS = DATA / "lm_eval"
MC, GEN = "jaxserve_tiny_mc", "jaxserve_tiny_gen"
# Loglikelihoods of a whole continuation (a few tokens), float32 in two implementations (XLA and torch, different
# matmul orders): measured differences are ~1e-5; the bound leaves room for other CPUs.
LOGLIKELIHOOD_ATOL = 2e-4


def evaluate(model, model_args: dict | None = None):
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[MC, GEN],
                                   task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def per_document(results) -> dict:
    """task -> [[doc id, its responses]]: loglikelihoods [float, is_greedy] per choice, or generations (as JSON
    holds them: lists, not tuples)."""
    return json.loads(json.dumps({task: sorted((s["doc_id"], s["filtered_resps"]) for s in samples)
                                  for task, samples in results["samples"].items()}))


@pytest.fixture
def in_task_dir(monkeypatch):
    monkeypatch.chdir(TASKS)  # the task files name their data files relative to it
    logging.getLogger("lm-eval").setLevel(logging.WARNING)


def test_lm_eval_local_completions_equals_hf(default_llm, in_task_dir):
    from serving import ServerThread
    st = ServerThread(default_llm, "SmolLM2-135M-Instruct")
    try:
        served = evaluate("local-completions", {
            "base_url": f"{st.url}/v1/completions", "model": "SmolLM2-135M-Instruct", "tokenizer_backend": "remote",
            "num_concurrent": 1, "max_retries": 1, "batch_size": 4})
    finally:
        st.stop()
    hf = json.loads((DATA / "lm_eval_hf.json").read_text())
    got, want = per_document(served), hf["documents"]
    assert [d for d, _ in got[MC]] == [d for d, _ in want[MC]] == list(range(6))
    worst = 0.0
    for (_, ours), (_, theirs) in zip(got[MC], want[MC]):
        assert len(ours) == len(theirs)
        for (lp, greedy), (ref, ref_greedy) in zip(ours, theirs):
            worst = max(worst, abs(lp - ref))
            assert lp == pytest.approx(ref, abs=LOGLIKELIHOOD_ATOL)
            assert greedy == ref_greedy
    print(f"largest loglikelihood difference against HF: {worst:.2e}")
    assert served["results"][MC]["acc,none"] == hf["acc"]
    assert got[GEN] == want[GEN] and len(got[GEN]) == 4  # greedy: the same text
    assert any(r[0].strip() for _, r in got[GEN])  # the model did say something
