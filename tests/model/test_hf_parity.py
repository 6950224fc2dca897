"""jaxserve against HF transformers on tiny random Llama / Qwen2 checkpoints: float32 logits and greedy tokens."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.runner.steps import Steps
from jaxserve.weights import load_model

from hf_models import VARIANTS, save_tiny_model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_model(request.param, path)


def test_logits_match_hf(tiny):
    path, hf = tiny
    rng = np.random.default_rng()
    prompt = rng.integers(0, hf.config.vocab_size, size=45).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()  # [T, V]
    loaded = load_model(str(path), jnp.float32)
    steps = Steps(loaded.config, jnp.float32)
    page_size = 4
    pages = list(range(1, 1 + pages_needed(len(prompt), page_size)))
    batch = build_batch([Row(prompt, 0, pages)], page_size, loaded.config.vocab_size, 64, 1, 16)
    got, _ = steps.forward_logits(loaded.params, init_kv_cache(loaded.config, 20, page_size, jnp.float32), batch)
    got = np.asarray(got[:len(prompt)])
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4


def hf_greedy_with_clear_margins(hf, length, rng, new_tokens=32, min_margin=5e-3):
    """A random prompt and HF's greedy continuation, redrawn until no step is a near-tie.

    A random model's top two logits are often within float32 noise of each other; there two correct
    implementations may pick different tokens, so such prompts say nothing about correctness.
    """
    for _ in range(50):
        prompt = rng.integers(0, hf.config.vocab_size, size=length).tolist()
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
        top2 = torch.stack(out.logits)[:, 0].topk(2).values
        if (top2[:, 0] - top2[:, 1]).min() > min_margin:
            return prompt, out.sequences[0, length:].tolist()
    raise AssertionError("no prompt without near-ties found")


def test_greedy_continuation_matches_hf(tiny):
    path, hf = tiny
    rng = np.random.default_rng()
    cases = [hf_greedy_with_clear_margins(hf, n, rng) for n in (5, 17, 33)]
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              warmup=False)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for (prompt, want), out in zip(cases, outs):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    llm.core.assert_idle_and_clean()
