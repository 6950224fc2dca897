"""Prompt logprobs (vLLM's `prompt_logprobs`) against HF transformers' log_softmax over the prompt, float32: across
prompt chunks, beside a prefix-cache hit, with n > 1, under preemption; `max_tokens=0` scoring; the step's blocked
scorer against a plain [T, V] log_softmax."""
import math

import jax
import numpy as np
import pytest
import torch

from jaxserve import SamplingParams
from jaxserve.sample.prompt_logprobs import block_scores, block_size, score_targets

from hf_models import save_tiny_model
from tiny import TINY_PAGE_BYTES, make_llm, prompts

TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-plp")
    model = save_tiny_model("llama", path)
    return str(path), model


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: log_softmax of HF's logits at each position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def check_against_hf(out, model, top: int, atol: float = 5e-5, rtol: float = 1e-5):
    """out.prompt_logprobs against HF: each prompt token's logprob and rank, and the top `top` at each position.
    Tolerances: float32 logprobs differ from HF's by tens of ulps of their size when a prefix hit or another chunk
    split sums attention in another order (-11.33398 against -11.33396; -3.019577 against -3.019556 in CI)."""
    ids = out.prompt_token_ids
    ref = hf_logprobs(model, ids)
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry, row, target = scored[p], ref[p - 1], ids[p]
        assert entry[target].logprob == pytest.approx(row[target], abs=atol, rel=rtol), (p, target)
        assert 1 + np.sum(row > row[target] + atol) <= entry[target].rank <= 1 + np.sum(row > row[target] - atol)
        tops = {t: lp for t, lp in entry.items() if t != target or lp.rank <= top}
        assert len(tops) == top and sorted(lp.rank for lp in tops.values()) == list(range(1, top + 1))
        for t, lp in tops.items():
            assert lp.logprob == pytest.approx(row[t], abs=atol, rel=rtol)
        np.testing.assert_allclose(sorted((lp.logprob for lp in tops.values()), reverse=True),
                                   np.sort(row)[::-1][:top], atol=atol, rtol=rtol)


def test_blocked_scores_equal_a_plain_log_softmax():
    """The device loop (packed asking tokens, a block at a time) against log_softmax over all [T, V]."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    rng = np.random.default_rng(seed)
    T, H, V = 64, 8, 50
    hidden = rng.normal(size=(T, H)).astype(np.float32)
    w = rng.normal(size=(H, V)).astype(np.float32)
    targets = np.where(rng.random(T) < 0.4, rng.integers(0, V, T), -1).astype(np.int32)
    assert block_size(T, V, 8 * V) == 8  # blocks of 8 tokens: several, and a last one part padding
    scorer = jax.jit(lambda h, t, top: score_targets(h, t, top, lambda x, a: block_scores(x @ w, a), V, 8 * V))
    got = scorer(hidden, targets, np.ones(T, bool))
    ref = np.asarray(jax.nn.log_softmax(hidden @ w, -1))
    asked = np.flatnonzero(targets >= 0)
    n = len(asked)
    np.testing.assert_allclose(got.logprobs[:n], ref[asked, targets[asked]], atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got.ranks[:n], 1 + np.sum(ref[asked] > ref[asked, targets[asked]][:, None], -1))
    np.testing.assert_array_equal(got.top_ids[:n, :5], np.argsort(-ref[asked], -1, kind="stable")[:, :5])
    # Without top-n (prompt_logprobs 0: a cascade's scoring pass): the same logprobs and ranks, and no top-k run
    # (its results stay the zeros of the skipped branch).
    bare = scorer(hidden, targets, np.zeros(T, bool))
    np.testing.assert_array_equal(bare.logprobs, got.logprobs, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(bare.ranks, got.ranks, err_msg=f"seed {seed}")
    assert not np.any(bare.top_ids) and not np.any(bare.top_logprobs), f"seed {seed}"
    # A block holding one token that wants its top-n computes the block's; the packed entries of blocks without
    # one stay zeros.
    one = np.zeros(T, bool)
    one[asked[0]] = True
    mixed = scorer(hidden, targets, one)
    np.testing.assert_array_equal(mixed.top_ids[:1], got.top_ids[:1], err_msg=f"seed {seed}")
    assert not np.any(mixed.top_ids[8:]), f"seed {seed}"


def test_prompt_logprobs_equal_hf_across_chunks_prefix_hits_and_n(tiny):
    path, model = tiny
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    rng = np.random.default_rng(seed)
    llm = make_llm(path, max_num_batched_tokens=16)  # a 40-token prompt takes 3 chunks
    ps = prompts(rng, [40, 17, 5, 1])
    shared = ps[0]["prompt_token_ids"][:24] + rng.integers(0, 320, 6).tolist()
    llm.generate(ps[0], SamplingParams(max_tokens=1), use_tqdm=False)  # its pages are cached now
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    outs = llm.generate(ps + [{"prompt_token_ids": shared}], params, use_tqdm=False)
    plain = llm.generate(ps + [{"prompt_token_ids": shared}], SamplingParams(temperature=0, max_tokens=3,
                                                                              ignore_eos=True), use_tqdm=False)
    for out, ref in zip(outs, plain):
        check_against_hf(out, model, TOP)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"seed {seed}"  # generation is unchanged
        assert ref.prompt_logprobs is None
    # n > 1: scored once per request (by its first sequence); every sample still generates
    n3 = llm.generate(ps[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0,
                                            ignore_eos=True), use_tqdm=False)[0]
    check_against_hf(n3, model, 0)
    assert [len(c.token_ids) for c in n3.outputs] == [4, 4, 4]
    llm.core.assert_idle_and_clean()


def test_prompt_logprobs_survive_preemption(tiny):
    """A KV pool too small for everyone: sequences scoring their prompts are preempted and recomputed, and their
    prompt logprobs are whole, each position once."""
    path, model = tiny
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    rng = np.random.default_rng(seed)
    llm = make_llm(path, max_num_batched_tokens=12, kv_cache_memory_bytes=16 * TINY_PAGE_BYTES, max_model_len=60)
    ps = prompts(rng, [30, 25, 20, 28])
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0, f"seed {seed}"
    for out in outs:
        check_against_hf(out, model, 1)
    llm.core.assert_idle_and_clean()


def test_prompt_logprobs_over_a_vocabulary_split_head(tmp_path):
    """Tensor parallel (2 devices): each device scores its slice of the vocabulary; the same scores as HF."""
    model = save_tiny_model("llama-8-heads", tmp_path)
    llm = make_llm(str(tmp_path), tensor_parallel_size=2, max_num_batched_tokens=16)
    ps = prompts(np.random.default_rng(), [30, 9])
    outs = llm.generate(ps, SamplingParams(max_tokens=0, prompt_logprobs=TOP), use_tqdm=False)
    for out in outs:
        check_against_hf(out, model, TOP)


def test_max_tokens_zero_scores_without_generating(tiny):
    path, model = tiny
    llm = make_llm(path)
    ids = prompts(np.random.default_rng(), [23])[0]
    out = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2), use_tqdm=False)[0]
    assert [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] == [([], "", "length")] * 2
    check_against_hf(out, model, 0)
    total = sum(entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids["prompt_token_ids"][1:]))
    ref = hf_logprobs(model, ids["prompt_token_ids"])
    assert math.isclose(total, sum(ref[p - 1, t] for p, t in enumerate(ids["prompt_token_ids"]) if p), abs_tol=1e-3)
    llm.core.assert_idle_and_clean()


def test_max_tokens_zero_when_the_last_chunk_leaves_one_token(tiny):
    """A prompt whose last chunk is one token (a step's budget plus one, or a budget shared with a decode) is still
    computed, though its request generates nothing (it used to wait forever: its length limit counted as reached)."""
    path, _ = tiny
    llm = make_llm(path)  # 16 tokens a step
    seed = int(np.random.default_rng().integers(2 ** 31))
    ps = prompts(np.random.default_rng(seed), [17, 33, 5, 16])
    params = [SamplingParams(max_tokens=0, prompt_logprobs=0)] * 3 + [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [len(o.prompt_logprobs) for o in outs[:3]] == [17, 33, 5], f"seed {seed}"
    assert all(o.outputs[0].finish_reason == "length" and not o.outputs[0].token_ids for o in outs[:3])
    assert len(outs[3].outputs[0].token_ids) == 8
    llm.core.assert_idle_and_clean()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens may be 0 only with prompt_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be an integer in"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in"),
    (dict(prompt_logprobs=True), "prompt_logprobs must be an integer in"),
    (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens must be"),
])
def test_bad_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---- the default model: against HF, and through the server ----

def test_default_model_prompt_logprobs_equal_hf(default_llm, hf_default_model):
    """Two prompt chunks (the engine's step holds 256 tokens), float32, against HF's log_softmax."""
    tok = default_llm.tokenizer
    text = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."] * 20)
    ids = tok.encode(text)[:300]
    out = default_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=5),
                               use_tqdm=False)[0]
    check_against_hf(out, hf_default_model, 5, atol=1e-4)
    assert out.prompt_logprobs[1][ids[1]].decoded_token == tok.decode([ids[1]], skip_special_tokens=False)


@pytest.fixture(scope="module")
def served(default_llm):
    from serving import ServerThread
    st = ServerThread(default_llm, "SmolLM2-135M-Instruct")
    yield st
    st.stop()


def post(st, path, body):
    import requests
    return requests.post(st.url + path, json=body, timeout=120)


def test_echo_returns_the_prompt_then_the_completion(served, default_llm):
    prompt = "The capital of France is"
    ids = default_llm.tokenizer.encode(prompt)
    plain = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2})
    echoed = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                              "echo": True, "prompt_logprobs": 1})
    assert plain.status_code == echoed.status_code == 200, echoed.text
    p, e = plain.json()["choices"][0], echoed.json()["choices"][0]
    assert e["text"] == prompt + p["text"]
    lp = e["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][n:] == p["logprobs"]["token_logprobs"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # each token starts where the one before ends, across the prompt / completion boundary too
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])
    # vLLM's prompt_logprobs, beside: the same scores, its own top n
    plp = e["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    for i in range(1, n):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == lp["token_logprobs"][i]
        assert len(plp[i]) in (1, 2) and all(v["rank"] <= 1 or k == str(ids[i]) for k, v in plp[i].items())
    ref = default_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0),
                               use_tqdm=False)[0].prompt_logprobs
    assert [ref[i][ids[i]].logprob for i in range(1, n)] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-5)


def test_echo_of_token_id_prompts_scores_them_without_generating(served, default_llm):
    """What lm-evaluation-harness sends for loglikelihoods (here with max_tokens 0): token-id prompts, a batch."""
    tok = default_llm.tokenizer
    batch = [tok.encode("Paris is the capital of France."), tok.encode("One, two, three, four")]
    r = post(served, "/v1/completions", {"prompt": batch, "max_tokens": 0, "echo": True, "logprobs": 1,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    for ids, choice in zip(batch, sorted(r.json()["choices"], key=lambda c: c["index"])):
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0


def test_streamed_echo_sends_the_prompt_first(served):
    import json

    import requests
    prompt = "Once upon a time"
    with requests.post(served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                              "echo": True, "stream": True}, stream=True,
                       timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    texts = [c["text"] for e in events for c in e["choices"]]
    assert texts[0].startswith(prompt) and not any(t.startswith(prompt) for t in texts[1:])
    whole = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True})
    assert "".join(texts) == whole.json()["choices"][0]["text"]


def test_chat_prompt_logprobs(served):
    r = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                              "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    tokens = post(served, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert plp[0] is None and len(plp) == len(tokens) == r.json()["usage"]["prompt_tokens"]
    assert all(list(entry) == [str(t)] for entry, t in zip(plp[1:], tokens[1:]))


def test_tokenizer_endpoints(served, default_llm):
    tok = default_llm.tokenizer
    r = post(served, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert r.status_code == 200 and r.json() == {"count": len(tok.encode("Hello world", add_special_tokens=False)),
                                                 "max_model_len": 512,
                                                 "tokens": tok.encode("Hello world", add_special_tokens=False)}
    chat = post(served, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert chat == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    assert post(served, "/detokenize", {"tokens": chat}).json() == {"prompt": tok.decode(chat, False)}
    import requests
    info = requests.get(served.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tok.id_to_token(tok.eos_token_ids[0]) and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 512
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/tokenize", {"prompt": "a", "nope": 1}, "nope"),
                              ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [tok.vocab_size + 10 ** 6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/detokenize", {"tokens": [1.5]}, "tokens")]:
        r = post(served, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


@pytest.mark.parametrize("T", [1, 8, 64])  # one token (a batch-1 decode), one block spans the step, several blocks
def test_no_head_runs_when_no_token_asks(T):
    """The scorer's [B, V] head is computed inside a branch taken only when a token asks: never in the program's
    top level, where XLA would run it every step (it hoists a loop body whose gather stops depending on the index
    once one block spans all T tokens)."""
    H, V = 16, 96
    w = np.ones((H, V), np.float32)
    scorer = jax.jit(lambda h, t: score_targets(h, t, t >= 0, lambda x, a: block_scores(x @ w, a), V, 8 * V))
    hlo = scorer.lower(np.ones((T, H), np.float32), -np.ones(T, np.int32)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    B = block_size(T, V, 8 * V)
    assert f"f32[{B},{V}]" in hlo, "the head's logits are not where this test looks for them"
    assert f"f32[{B},{V}]" not in entry, f"the [{B}, {V}] head runs at the top level of the step:\n{entry}"
