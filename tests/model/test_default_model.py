"""The real default model (SmolLM2-135M-Instruct) against HF transformers' recorded and live outputs."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve import SamplingParams
from jaxserve.cache import init_kv_cache, pages_needed
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.runner.steps import Steps
from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS
from jaxserve.weights import load_model

from locations import DATA

REFS = json.loads((DATA / "smollm2_greedy.json").read_text())["cases"]


@pytest.mark.parametrize("case", REFS, ids=[c["name"] for c in REFS])
def test_greedy_matches_recorded_hf_reference(default_llm, case):
    params = SamplingParams(temperature=0, max_tokens=case["max_new_tokens"])
    if case["messages"]:
        out = default_llm.chat(case["messages"], params, use_tqdm=False)[0]
    else:
        out = default_llm.generate(case["prompt"], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == case["prompt_token_ids"]
    assert out.outputs[0].token_ids == case["greedy_token_ids"]
    assert out.outputs[0].finish_reason == ("stop" if case["finished_by_eos"] else "length")
    assert out.outputs[0].text == case["greedy_text"].removesuffix("<|im_end|>")


def forward_logits(loaded, prompt, page_size=16):
    steps = Steps(loaded.config, jnp.float32)
    pages = list(range(1, 1 + pages_needed(len(prompt), page_size)))
    batch = build_batch([Row(prompt, 0, pages)], page_size, loaded.config.vocab_size, len(prompt), 1, len(pages))
    cache = init_kv_cache(loaded.config, len(pages) + 1, page_size, jnp.float32)
    return np.asarray(steps.forward_logits(loaded.params, cache, batch)[0])


def test_logits_match_hf_on_the_same_gguf(default_gguf_path, hf_default_model):
    loaded = load_model(str(default_gguf_path), jnp.float32)
    prompt = loaded.tokenizer.encode("Once upon a time, in a small village, there lived a curious fox who "
                                     "counted 1234 stars every night. def f(x): return x ** 2")
    with torch.no_grad():
        want = hf_default_model(torch.tensor([prompt])).logits[0].numpy()
    got = forward_logits(loaded, prompt)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-3


def test_orbax_checkpoint_loads_to_the_same_model(default_gguf_path, tmp_path):
    from jaxserve.cli import main
    assert main(["convert", str(default_gguf_path), str(tmp_path / "ckpt")]) == 0
    a = load_model(str(default_gguf_path), jnp.float32)
    b = load_model(str(tmp_path / "ckpt"), jnp.float32)
    assert a.config == b.config
    prompt = a.tokenizer.encode("The capital of France is")
    assert b.tokenizer.encode("The capital of France is") == prompt
    assert b.tokenizer.eos_token_ids == a.tokenizer.eos_token_ids
    np.testing.assert_array_equal(forward_logits(a, prompt), forward_logits(b, prompt))
    assert main(["convert", str(default_gguf_path), str(tmp_path / "ckpt")]) == 1  # refuses to overwrite


def test_stop_strings_and_streaming_text(default_llm):
    full = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(" Paris.\n\nThe answer")
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["."]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == " Paris" and out.finish_reason == "stop" and out.stop_reason == "."
    out = default_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=12, stop=["answer"], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == " Paris.\n\nThe answer"
    pieces = list(default_llm.stream("The capital of France is", SamplingParams(temperature=0, max_tokens=12)))
    assert len(pieces) > 3 and "".join(pieces) == full.text
    # A stop string that spans tokens: no part of it is streamed (the newlines are held back until "answer" decides).
    sp = SamplingParams(temperature=0, max_tokens=12, stop=["\n\nThe answer"])
    pieces = list(default_llm.stream("The capital of France is", sp))
    assert "".join(pieces) == default_llm.generate("The capital of France is", sp, use_tqdm=False)[0].outputs[0].text
    assert "".join(pieces) == " Paris."
    default_llm.core.assert_idle_and_clean()


def test_min_tokens_bans_every_eos_and_stop_id(default_llm):
    """The default model has two EOS ids: with the most stop ids a request may give, the device ban list still fits
    (it used to overflow and fail every running request)."""
    eos = default_llm.tokenizer.eos_token_ids
    assert len(eos) == 2
    free = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].token_ids
    stops = [t for t in range(100, 200) if t not in free][:MAX_STOP_TOKEN_IDS]
    out = default_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=stops), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free and out.finish_reason == "length"
    default_llm.core.assert_idle_and_clean()


def test_seeded_sampling_gives_the_same_text(default_llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16)
    a = default_llm.generate("Write a haiku about the sea.", sp, use_tqdm=False)[0].outputs[0].text
    b = default_llm.generate(["Write a haiku about the sea.", "Hello"], sp, use_tqdm=False)[0].outputs[0].text
    assert a == b


def test_skip_special_tokens(default_llm):
    case = next(c for c in REFS if c["name"] == "capital")
    kept = default_llm.generate(case["prompt"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                               skip_special_tokens=False), use_tqdm=False)[0]
    skipped = default_llm.generate(case["prompt"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                   use_tqdm=False)[0]
    assert "<|im_end|>" in kept.outputs[0].text and "<|im_end|>" not in skipped.outputs[0].text


def test_tokens_do_not_depend_on_what_shares_the_step(default_llm):
    """Batch invariance on the real model: a request's greedy and seeded tokens are the same whether it runs alone
    or in ragged steps with others (a prompt longer than the step budget, chunked; two prompts sharing a prefix, so
    the second hits the prefix cache; decode rows beside prompt chunks)."""
    from pydoc_data.topics import topics
    system = "You are a careful assistant who answers in one short sentence. " * 8
    long_text = topics[sorted(topics)[0]][:1500]  # ~300 tokens: more than one step's 256
    prompts = [system + "Name a fruit.", long_text, system + "Name a colour.", "The capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    default_llm.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    alone = [default_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
