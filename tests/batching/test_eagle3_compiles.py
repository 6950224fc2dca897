"""EAGLE-3 after warm-up: serving compiles nothing, neither the target's steps (with the head's features captured),
nor the head's, nor any other program (an eager op on a device array compiles one too)."""
import jax
import numpy as np

from jaxserve import SamplingParams
from jaxserve.weights import load_model

from eagle3_heads import write_tiny_head
from tiny import make_llm, prompts


def test_nothing_compiles_after_warmup(tiny_dir, tmp_path):
    """Prompt chunks of every size, decodes of 1 to 4 rows, chains of k = 3 (adaptive off: every decode
    speculates), catch-up rows after partial acceptance, prefix hits, greedy and seeded sampling."""
    head_dir = write_tiny_head(tmp_path / "head", load_model(tiny_dir, "float32").config, "speculators", seed=5)
    llm = make_llm(tiny_dir, max_num_batched_tokens=32, warmup=True, speculative_config=dict(
        method="eagle3", model=head_dir, num_speculative_tokens=3, adaptive=False))
    target, head = llm.runner, llm.core.proposer.runner
    compiled = (target.steps.num_compiled(), head.steps.num_compiled())
    assert all(compiled)
    compiles = []

    def on_compile(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 320, 13).tolist()
    sps = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True),
           SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
           SamplingParams(n=2, temperature=1.0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True, logprobs=1)]
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        for count in (1, 2, 3, 5):
            ps = prompts(rng, rng.integers(1, 70, count))
            llm.generate(ps, [sps[i % len(sps)] for i in range(count)], use_tqdm=False)
        for n in (1, 3, 7, 15, 30):  # a prompt alone in each chunk size, after a shared prefix (a hit from the 2nd)
            llm.generate({"prompt_token_ids": shared + rng.integers(0, 320, n).tolist()},
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert llm.stats().spec_decode_num_draft_tokens > 0
    assert compiles == [], f"seed {seed}"
    assert (target.steps.num_compiled(), head.steps.num_compiled()) == compiled, f"seed {seed}"
    llm.core.assert_idle_and_clean()
