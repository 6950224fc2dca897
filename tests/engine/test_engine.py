"""The LLM loop on a tiny random model: paging, batching, compilation, limits and bad input."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, EngineConfig, SamplingParams
from jaxserve.runner.steps import steps_for
from jaxserve.sampling_params import StructuredOutputsParams

from tiny import TINY_PAGE_BYTES, make_llm, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def all_pages_free(llm):
    llm.core.assert_idle_and_clean()
    return True


def test_page_size_does_not_change_tokens(tiny_dir):
    ps = prompts(np.random.default_rng(), [1, 3, 4, 5, 15, 16, 17, 33])  # around page and chunk boundaries
    results = []
    for block_size in (1, 4, 16):
        llm = make_llm(tiny_dir, block_size=block_size)
        results.append([o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)])
        assert all_pages_free(llm)
    assert results[0] == results[1] == results[2]


def test_batching_does_not_change_greedy_tokens(tiny_dir):
    ps = prompts(np.random.default_rng(), [7, 30, 2, 19, 11, 25])
    llm = make_llm(tiny_dir)
    together = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    assert together == alone


@pytest.mark.parametrize("speculation", [None, "ngram", "draft"])
def test_no_compilation_after_warmup(tiny_tokenized_dir, other_tiny_dir, speculation):
    """Every bucket, plain and verifying, with every sampling feature in use: a grammar's masks among them."""
    steps_for.cache_clear()  # jitted steps are shared per model config; start from none compiled
    config = {None: None, "ngram": dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1),
              "draft": dict(method="draft_model", model=other_tiny_dir, num_speculative_tokens=2)}[speculation]
    if config:
        config["adaptive"] = False  # verification programs in every step where a sequence decodes
    llm = make_llm(tiny_tokenized_dir, max_num_batched_tokens=64, warmup=True,  # steps of 1, 4, 8 ... 64 tokens
                   speculative_config=config)
    runners = [llm.runner] + ([llm.core.proposer.runner] if speculation == "draft" else [])
    compiled = [r.steps.num_compiled() for r in runners]
    shapes = list(llm.runner.buckets.shapes())
    verify_shapes = [(t, r) for t, r in shapes if t > 1] if config else []
    # A forward (and where it does not write the cache, a cache write) per step size, a verification forward per
    # size but one token, and a split step's sampling half per row count.
    per_size = 1 if llm.runner.steps.writes_in_forward else 2
    split = len({r for _, r in shapes}) if llm.runner.splits_sampling else 0
    assert compiled[0] == per_size * len(shapes) + len(verify_shapes) + split
    used = set()
    step = llm.runner.steps.step_with_features

    def recording(params, kv_cache, last_tokens, features, batch, lora=None, **kw):
        used.add((batch.num_tokens, batch.num_rows, batch.logits_index.shape[1] > 1))
        return step(params, kv_cache, last_tokens, features, batch, lora, **kw)

    llm.runner.steps.step_with_features = recording
    # Count every XLA compilation, not only the steps': an eager op on a device array compiles a program too.
    compiles = []

    def on_compile(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    rng = np.random.default_rng()
    mixed = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3, max_tokens=20, logprobs=2,
                            min_tokens=2),
             SamplingParams(n=3, temperature=1.0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=9, logprobs=0, ignore_eos=True),
             # Logit controls: penalties (their rows never speculate), logit_bias and allowed ids (theirs do).
             SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=-0.2, repetition_penalty=1.2),
             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={3: 2.0, 7: -50.0},
                            allowed_token_ids=list(range(0, 320, 3))),
             SamplingParams(n=2, temperature=0.9, max_tokens=int(rng.integers(1, 30)), logprobs=1,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}( [0-9]{1,3}){0,8}")),
             SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
                 json={"type": "object", "properties": {"k": {"type": "integer"}, "s": {"type": "string"}}})),
             # prompt logprobs: the step's scorer runs over the asking tokens, in programs compiled at warm-up
             SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=0, prompt_logprobs=0)]
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        # Batches of 1 to 9 requests (decode batches of every size), prompts from 1 to 90 tokens (both chunk sizes).
        for count in (1, 2, 3, 5, 9):
            ps = prompts(rng, rng.integers(1, 91, count))
            llm.generate(ps, [mixed[i % len(mixed)] for i in rng.permutation(count)], use_tqdm=False)
        for n in (1, 3, 7, 15, 30, 60):  # and a prompt alone in each bucket, whatever the random ones hit
            llm.generate(prompts(rng, [n]), SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert compiles == []
    assert [r.steps.num_compiled() for r in runners] == compiled
    expected = {(t, r, False) for t, r in shapes} | {(t, r, True) for t, r in verify_shapes}
    if config is None:
        assert used == expected  # the workload ran every bucket
    else:  # speculating rows take the verification programs, so fewer plain steps run
        assert used <= expected and any(verifying for _, _, verifying in used)


def test_one_program_and_one_copy_back_per_step(tiny_dir, monkeypatch):
    """A step is one forward program (which writes the cache on one CPU device: jaxserve.runner.steps; elsewhere one
    cache write besides) and one device-to-host copy, whatever its mix of decode rows and prompt chunks (implicit
    transfers are refused outright)."""
    llm = make_llm(tiny_dir)
    counts = {"forward": 0, "write": 0, "device_get": 0}
    steps = llm.runner.steps

    def counting(name, f):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return f(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(steps, "_forward", counting("forward", steps._forward))
    monkeypatch.setattr(steps, "_write", counting("write", steps._write))
    monkeypatch.setattr(jax, "device_get", counting("device_get", jax.device_get))
    before = llm.core.counters.steps
    with jax.transfer_guard_device_to_host("disallow"):
        llm.generate(prompts(np.random.default_rng(), [3, 40, 17, 9, 60]), SamplingParams(max_tokens=12),
                     use_tqdm=False)
    steps_run = llm.core.counters.steps - before
    assert steps_run > 0
    writes = 0 if steps.writes_in_forward else steps_run
    assert counts == {"forward": steps_run, "write": writes, "device_get": steps_run}


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_dir):
    ps = prompts(np.random.default_rng(), [9, 21])
    llm = make_llm(tiny_dir)
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = llm.generate(ps, sp, use_tqdm=False)
    b = llm.generate(ps[:1], sp, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    other = llm.generate(ps[:1], SamplingParams(temperature=1.0, seed=99, max_tokens=16), use_tqdm=False)
    assert other[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_n_samples_and_limits(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompts(np.random.default_rng(), [10])
    out = llm.generate(p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # max_tokens=None runs to max_model_len.
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 96
    assert all_pages_free(llm)


def test_stop_token_ids_and_min_tokens(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompts(np.random.default_rng(), [6])
    free = llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = free[4]
    first = free.index(stop)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    # min_tokens keeps the stop token from being sampled before it is reached.
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 3, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert stop not in out.outputs[0].token_ids[:first + 3]
    assert len(out.outputs[0].token_ids) >= first + 3


def test_logprobs_returned_on_request(tiny_dir):
    llm = make_llm(tiny_dir)
    out = llm.generate(prompts(np.random.default_rng(), [5]),
                       SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3  # greedy: the chosen token is the top one
        assert max(e.logprob for e in entry.values()) == entry[tok].logprob <= 0
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_bad_prompts_raise_and_leave_no_pages(tiny_dir):
    llm = make_llm(tiny_dir)
    good = prompts(np.random.default_rng(), [5])[0]
    for bad in [{"prompt_token_ids": []}, {"prompt_token_ids": [1] * 96}, {"prompt_token_ids": [320]},
                {"prompt_token_ids": [-1]}, "text but no tokenizer", 42]:
        with pytest.raises((ValueError, TypeError)):
            llm.generate([good, bad], GREEDY, use_tqdm=False)
        assert all_pages_free(llm)
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_bad_engine_arguments(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        LLM(str(tmp_path / "missing"), warmup=False)
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(tiny_dir, max_model_len=100000)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_llm(tiny_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        make_llm(tiny_dir, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_llm(tiny_dir, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="attention_backend"):
        make_llm(tiny_dir, attention_backend="flash")
    with pytest.raises(ValueError, match="tpot_slo"):
        make_llm(tiny_dir, tpot_slo=0)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, '
                                          '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), warmup=False)
    longrope = json.loads((Path(tiny_dir) / "config.json").read_text())
    longrope["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(longrope))
    with pytest.raises(ValueError, match="unsupported rope scaling 'longrope'"):
        LLM(str(tmp_path), warmup=False)


def test_bad_priorities_are_refused(tiny_dir):
    llm = make_llm(tiny_dir)
    ps = prompts(np.random.default_rng(), [4, 5])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(ps, GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(TypeError, match="priority"):
        llm.generate(ps, GREEDY, use_tqdm=False, priority=[0, "high"])
    assert all_pages_free(llm)


def test_max_model_len_must_fit_the_kv_cache(tiny_dir):
    """One sequence of max_model_len must fit the KV cache, or a request leaving max_tokens unset could never run
    while the length is advertised: an explicit max_model_len that does not fit is refused at start, the model's
    own context is lowered to what fits."""
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        make_llm(tiny_dir, kv_cache_memory_bytes=12 * TINY_PAGE_BYTES)  # 11 usable pages of 4 tokens < 96
    llm = make_llm(tiny_dir, max_model_len=None, kv_cache_memory_bytes=12 * TINY_PAGE_BYTES)
    assert llm.max_model_len == 44
    out = llm.generate(prompts(np.random.default_rng(), [10]), SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 44
    assert all_pages_free(llm)


def test_request_api_step_by_step(tiny_dir):
    """The public request API, driven as AsyncEngine drives it: the same tokens as generate, aborts free pages."""
    llm = LLM.from_config(EngineConfig(dtype="float32", model=tiny_dir, max_model_len=96, block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=16, warmup=False))
    assert llm.engine_config.max_num_seqs == 4
    ps = prompts(np.random.default_rng(), [7, 12])
    want = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    kept = llm.make_request(ps[0], GREEDY, request_id="kept")
    seqs = kept.seqs
    assert not llm.has_unfinished_requests()  # made, not yet submitted
    llm.submit(kept)
    dropped = llm.add_request(ps[1], GREEDY).request_id
    llm.step()
    llm.abort_request(dropped)
    while llm.has_unfinished_requests():
        llm.step()
    assert seqs[0].output_token_ids == want[0] and seqs[0].finish_reason == "length"
    assert all_pages_free(llm)
    with pytest.raises(ValueError, match="max_model_len"):  # refused before anything is queued
        llm.make_request({"prompt_token_ids": [1] * 96}, GREEDY)
    assert not llm.has_unfinished_requests()
