"""Logit controls: presence, frequency and repetition penalties, logit_bias, allowed_token_ids and bad_words.

Against a numpy reference of vLLM's rules (on device, on random logits; in the engine, greedy decoding over HF
transformers' logits of the same tiny checkpoint), HF's own `generate(repetition_penalty=...)`, batch invariance
(a controlled row leaves its neighbours' tokens alone) and speculative decoding (outputs unchanged).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import SamplingParams
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
from jaxserve.sample import token_mask
from jaxserve.sample.logit_controls import LogitControls, bad_word_bans, bad_words_token_ids, resolve
from jaxserve.sample.sampling import controlled, masked, with_step_tokens
from jaxserve.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, ParamError

from tiny import make_llm

VOCAB = 320  # the tiny model's


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(2**31))


# ---- the numpy reference: vLLM v1's order (mask, bad words, logit_bias, repetition, frequency and presence) ----

def banned_by_bad_words(words, generated) -> set[int]:
    """vLLM's rule, on the whole list of generated tokens: a word's last token while they end with its others."""
    out = set()
    for w in words:
        k = len(w) - 1
        if len(w) <= len(generated) + 1 and list(generated[len(generated) - k:]) == list(w[:k]):
            out.add(w[-1])
    return out


def reference(logits, prompt, generated, allowed=None, bad_words=(), logit_bias=None, presence=0.0, frequency=0.0,
              repetition=1.0):
    x = np.array(logits, np.float32)
    if allowed is not None:
        keep = np.zeros(len(x), bool)
        keep[list(allowed)] = True
        x[~keep] = -np.inf
    x[list(banned_by_bad_words(bad_words, generated))] = -np.inf
    for t, b in (logit_bias or {}).items():
        x[t] += np.float32(b)
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(generated)] = True
    r = np.float32(repetition)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(x)).astype(np.float32)
    return x - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)


# ---- on device: the transforms against the reference, on random logits ----

def _device_controls(logits, batch):
    p = with_step_tokens(batch.sampling, batch.token_ids, batch.rows, batch.logits_index[:, 0])
    return controlled(masked(logits, p.token_mask), p)


device_controls = jax.jit(_device_controls)


def random_row(rng, V, kind):
    """A sequence (prompt, generated) of random tokens from a small alphabet (so tokens repeat), its controls, and
    its row in a step: a decode (its last token new) or a prompt chunk reaching its end."""
    alphabet = rng.choice(V, 12, replace=False)
    P, G = int(rng.integers(1, 20)), int(rng.integers(0, 15))
    tokens = rng.choice(alphabet, P + G).tolist()
    prompt, generated = tokens[:P], tokens[P:]
    c = {}
    if kind in ("penalties", "all"):
        c.update(presence=float(rng.uniform(-2, 2)), frequency=float(rng.uniform(-2, 2)),
                 repetition=float(rng.uniform(0.5, 2)))
    if kind in ("bias", "all"):
        ids = rng.choice(V, int(rng.integers(1, 20)), replace=False)
        c["logit_bias"] = {int(t): float(b) for t, b in zip(ids, rng.uniform(-100, 100, len(ids)))}
    if kind in ("words", "all"):
        # Words whose others tokens end the generated ones (so they ban), others that do not, one-token ones.
        words = [(int(rng.choice(alphabet)),)]
        for k in (1, 2, 3):
            tail = tuple(generated[len(generated) - k:]) if len(generated) >= k else tuple(rng.choice(alphabet, k))
            words += [tail + (int(rng.choice(V)),), tuple(int(t) for t in rng.choice(alphabet, k + 1))]
        c["bad_words"] = words
        if rng.random() < 0.5:
            c["allowed"] = set(rng.choice(V, V // 2, replace=False).tolist())
    start = P + G - 1 if G and rng.random() < 0.7 else int(rng.integers(0, P + G))  # a decode, or a chunk
    return prompt, generated, c, start


def row_sampling(prompt, generated, c, V):
    words = c.get("bad_words", ())
    mask = token_mask.allowing(c["allowed"], V) if "allowed" in c else None
    single = [w[0] for w in words if len(w) == 1]
    if single:
        mask = token_mask.forbidding(token_mask.allow_all(V) if mask is None else mask, single)
    longer = tuple(w for w in words if len(w) > 1)
    bias = c.get("logit_bias")
    penalised = any(k in c for k in ("presence", "frequency", "repetition"))
    return RowSampling(
        token_mask=mask, bad_word_bans=bad_word_bans(longer, generated, len(generated)) if generated else (),
        logit_bias=(np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32)) if bias else None,
        presence_penalty=c.get("presence", 0.0), frequency_penalty=c.get("frequency", 0.0),
        repetition_penalty=c.get("repetition", 1.0),
        past_tokens=np.array(prompt + generated, np.int32) if penalised else None, prompt_len=len(prompt))


@pytest.mark.parametrize("kinds", [["penalties", "none"], ["bias", "none"], ["words", "none"],
                                   ["all", "penalties", "bias", "words", "none"]])
def test_controls_on_device_match_numpy(kinds):
    """Rows of each kind beside plain ones, decodes and prompt chunks, the row's last tokens known on device only
    (the host sends those before its start): the logits equal the reference's, a plain row's bit for bit."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    V, S, page_size = 100, 8, 4
    rows, cases = [], []
    for i in range(S):
        prompt, generated, c, start = random_row(rng, V, kinds[i % len(kinds)] if i < S - 1 else "none")
        tokens = prompt + generated
        pages = list(range(1 + 12 * i, 1 + 12 * i + -(-len(tokens) // page_size)))
        rows.append(Row(tokens[start:], start, pages, row_sampling(prompt, generated, c, V)))
        cases.append((prompt, generated, c))
    batch = build_batch(rows, page_size, V, 512, S, 12)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    got = np.asarray(device_controls(jnp.asarray(logits), batch))
    for i, (prompt, generated, c) in enumerate(cases):
        want = reference(logits[i], prompt, generated, **c)
        if not c:
            np.testing.assert_array_equal(got[i], logits[i], err_msg=f"seed {seed}, row {i}: a plain row changed")
        else:
            np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=f"seed {seed}, row {i} {c}")
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-4, err_msg=f"seed {seed}, row {i} {c}")


def test_no_controls_no_work():
    """A batch without controls holds constants for them, and the step leaves the logits untouched."""
    from jaxserve.batch import is_constant
    batch = build_batch([Row([1, 2, 3], 0, [1])], 4, 50, 8, 2, 4)
    for name in ("bad_word_bans", "logit_bias_ids", "logit_bias", "past_tokens", "token_mask"):
        assert is_constant(getattr(batch.sampling, name)), name
    assert batch.sampling.past_tokens.shape == (2, 16)  # pages_per_row x page_size: a row's most tokens
    logits = np.random.default_rng(0).normal(size=(2, 50)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(device_controls(jnp.asarray(logits), batch)), logits)


def test_bad_word_bans_follow_vllms_rule():
    """The host's (trigger, banned) pairs plus the device's check of the last token ban what vLLM's rule bans on
    the whole generated list, at every length, whatever the words."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(300):
        generated = rng.integers(0, 4, int(rng.integers(0, 8))).tolist()
        words = tuple(tuple(rng.integers(0, 4, int(rng.integers(2, 5))).tolist()) for _ in range(4))
        want = banned_by_bad_words(words, generated)
        pairs = bad_word_bans(words, generated, len(generated)) if generated else ()
        got = {b for t, b in pairs if t == generated[-1]}
        assert got == want, f"seed {seed}: {words} after {generated}"
        assert len(set(pairs)) == len(pairs)
        # The last token may still be in flight: only the tokens before it are read.
        if generated:
            assert bad_word_bans(words, generated[:-1] + [99], len(generated)) == pairs


def test_bad_words_are_tokenized_as_vllm_does():
    tok = byte_tokenizer()
    # Without a space and with one; a word the space merges into is spelled once.
    assert bad_words_token_ids(["bc"], tok) == [tok.encode("bc", False)]  # " bc" is 3 tokens: not a spelling
    assert tok.encode(" bc", False) != tok.encode("bc", False)
    c = resolve(SamplingParams(bad_words=["b", " cd"]), VOCAB, tok)
    assert token_mask.allowed_ids(c.token_mask, VOCAB).tolist() == [t for t in range(VOCAB) if t != tok.encode("b")[0]]
    assert c.bad_words == (tuple(tok.encode("cd", False)),)


def test_resolve_checks_ids_against_the_vocabulary():
    for params, name in [(SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
                         (SamplingParams(allowed_token_ids=[1, VOCAB + 5]), "allowed_token_ids")]:
        with pytest.raises(ParamError, match="outside the vocabulary") as e:
            resolve(params, VOCAB)
        assert e.value.param == name
    with pytest.raises(ParamError, match="tokenizer"):
        resolve(SamplingParams(bad_words=["x"]), VOCAB)
    assert resolve(SamplingParams(), VOCAB) == LogitControls()


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={"1": 1}),
                                                                                           "logit_bias"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"), (dict(bad_words="x"), "bad_words"),
    (dict(bad_words=[" "]), "bad_words"), (dict(bad_words=["x"] * (MAX_BAD_WORDS + 1)), "bad_words"),
])
def test_bad_values_are_refused_naming_the_param(kwargs, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


# ---- in the engine, on the tiny model ----

def byte_tokenizer():
    """A byte-level BPE inside the tiny model's vocabulary (its 256 bytes, then "aa")."""
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.tokenizer.alphabet import BYTE_OF_CHAR
    from jaxserve.tokenizer.gguf_vocab import byte_level_bpe
    return Tokenizer(byte_level_bpe([*BYTE_OF_CHAR, "aa"], ["a a"], "gpt2"), bos_token_id=None, eos_token_ids=[],
                     add_bos=False, chat_template=None)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def reference_greedy(hf, prompt, n, min_margin=5e-3, prefix=(), **controls):
    """Greedy decoding with the reference controls over HF's logits; None where a step is a near-tie (two correct
    implementations may pick either token there). prefix: tokens before the prompt counted as generated ones."""
    generated = list(prefix)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0, -1].numpy()
        x = reference(logits, prompt, generated, **controls)
        top2 = np.sort(x[np.isfinite(x)])[-2:]
        if len(top2) == 2 and top2[1] - top2[0] < min_margin:
            return None
        generated.append(int(np.argmax(x)))
    return generated[len(prefix):]


def clear_cases(hf, rng, lengths, n, **controls):
    out = []
    for length in lengths:
        for _ in range(30):
            prompt = rng.choice(np.arange(3, 40), length).tolist()  # a small alphabet: prompt tokens recur
            want = reference_greedy(hf, prompt, n, **controls)
            if want is not None:
                out.append((prompt, want))
                break
        else:
            raise AssertionError("no prompt without near-ties found")
    return out


def letters(tok, text):
    return [tok.encode(ch, False)[0] for ch in text]


CONTROLS = {
    "presence-frequency": lambda tok: dict(presence_penalty=1.5, frequency_penalty=0.7),
    "negative-presence": lambda tok: dict(presence_penalty=-2.0, frequency_penalty=-0.3),
    "repetition": lambda tok: dict(repetition_penalty=1.8),
    "logit-bias": lambda tok: dict(logit_bias={5: 3.0, 17: -100.0, 30: 2.5, 300: 4.0}),
    "allowed-bad-words": lambda tok: dict(allowed_token_ids=letters(tok, "bcdefghi"), bad_words=["c", "de", "fgh"]),
}


def as_reference(tok, params: dict) -> dict:
    out = dict(presence=params.get("presence_penalty", 0.0), frequency=params.get("frequency_penalty", 0.0),
               repetition=params.get("repetition_penalty", 1.0), logit_bias=params.get("logit_bias"))
    if "allowed_token_ids" in params:
        out["allowed"] = params["allowed_token_ids"]
    if "bad_words" in params:
        out["bad_words"] = [tuple(ids) for ids in bad_words_token_ids(params["bad_words"], tok)]
    return out


@pytest.fixture(scope="module")
def tok_llm(tiny_dir):
    """The tiny model with a byte tokenizer (for bad_words), 4 slots, prompt chunks of up to 16 tokens."""
    llm = make_llm(tiny_dir)
    llm.tokenizer = byte_tokenizer()
    return llm


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_greedy_generation_matches_the_reference(tok_llm, hf_tiny, name):
    """Each control alone, greedy, prompts whose tokens recur (so they count), some longer than a prompt chunk:
    the tokens the reference decodes over HF's logits; prompt tokens count for repetition only."""
    seed = fresh_seed()
    params = CONTROLS[name](tok_llm.tokenizer)
    n = 12
    cases = clear_cases(hf_tiny, np.random.default_rng(seed), (3, 11, 29), n, **as_reference(tok_llm.tokenizer, params))
    outs = tok_llm.generate([{"prompt_token_ids": p} for p, _ in cases],
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for _, want in cases], f"seed {seed}"
    tok_llm.core.assert_idle_and_clean()


def test_bad_words_of_several_tokens_are_banned_where_they_would_complete(tok_llm, hf_tiny):
    """Words cut from the greedy continuation itself (so each must be banned as it would complete, its other tokens
    generated by the step before, still in flight), beside allowed_token_ids and a one-token word."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    tok = tok_llm.tokenizer
    allowed = letters(tok, "bcdefghi")
    for _ in range(30):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 30))).tolist()
        plain = reference_greedy(hf_tiny, prompt, 12, allowed=allowed)
        if plain is None:
            continue
        single = next(ch for ch in "bcdefghi" if letters(tok, ch)[0] not in plain[:9])
        params = dict(allowed_token_ids=allowed, bad_words=[tok.decode(plain[3:5]), tok.decode(plain[6:9]), single])
        want = reference_greedy(hf_tiny, prompt, 12, **as_reference(tok, params))
        # the first word banned as it would complete, not earlier (its tokens may also stand earlier in a
        # continuation that repeats a letter: [66, 68, 68, 68] bans "dd" from position 1)
        if want is not None and want[:4] == plain[:4] and want[4] != plain[4]:
            break
    else:
        raise AssertionError(f"seed {seed}: no prompt without near-ties whose first word completes at 4 found")
    out = tok_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                        **params), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want, f"seed {seed}: {params}"


def test_prompt_tokens_do_not_count_for_presence_and_frequency(tok_llm, hf_tiny):
    """Prompts that hold the tokens their greedy continuation wants (so counting the prompt would change the
    output): the reference over generated tokens only is what comes out."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    penalties = dict(presence=2.0, frequency=1.0)
    for _ in range(30):
        prompt = rng.integers(0, VOCAB, 6).tolist()
        plain = reference_greedy(hf_tiny, prompt, 6)
        if plain is None:
            continue
        prompt += plain
        want = reference_greedy(hf_tiny, prompt, 6, **penalties)
        counting_the_prompt = reference_greedy(hf_tiny, [], 6, prefix=prompt, **penalties)
        if want is not None and counting_the_prompt is not None and want != counting_the_prompt:
            break
    else:
        raise AssertionError(f"seed {seed}: no prompt whose penalised continuation depends on counting it")
    out = tok_llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want, f"seed {seed}"


def test_repetition_penalty_matches_hf_generate(tok_llm, hf_tiny):
    """HF transformers' own greedy generate(repetition_penalty=...) on the same checkpoint."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < 3:
        prompt = rng.choice(np.arange(3, 40), int(rng.integers(4, 30))).tolist()
        with torch.no_grad():
            out = hf_tiny.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   repetition_penalty=1.6, output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack(out.scores)[:, 0].topk(2).values  # the scores after the penalty
        if (top2[:, 0] - top2[:, 1]).min() > 5e-3:
            cases.append((prompt, out.sequences[0, len(prompt):].tolist()))
    outs = tok_llm.generate([{"prompt_token_ids": p} for p, _ in cases],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.6),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for _, want in cases], f"seed {seed}"


def mixed_requests(tok, rng):
    """Plain requests (greedy and seeded sampling) and controlled ones, all controls, greedy and sampled."""
    plain = [({"prompt_token_ids": rng.integers(0, VOCAB, int(n)).tolist()}, SamplingParams(
        temperature=t, seed=int(rng.integers(1000)), max_tokens=14, ignore_eos=True, logprobs=2))
        for n, t in zip(rng.integers(1, 40, 5), (0, 0.8, 0, 1.0, 0))]
    controlled_ = [({"prompt_token_ids": rng.integers(0, VOCAB, int(n)).tolist()}, SamplingParams(
        temperature=t, seed=7, max_tokens=14, ignore_eos=True, **CONTROLS[name](tok)))
        for n, t, name in zip(rng.integers(1, 40, 5), (0, 0.9, 0, 1.0, 0.7), sorted(CONTROLS))]
    return plain, controlled_


def run(llm, requests):
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in requests], [s for _, s in requests],
                                                         use_tqdm=False)]


def test_controlled_rows_leave_their_neighbours_alone(tok_llm):
    """Plain requests batched beside penalised, biased, masked and bad-worded ones: token for token what they give
    alone."""
    seed = fresh_seed()
    plain, controlled_ = mixed_requests(tok_llm.tokenizer, np.random.default_rng(seed))
    alone = run(tok_llm, plain)
    together = run(tok_llm, [r for pair in zip(plain, controlled_) for r in pair])
    assert together[0::2] == alone, f"seed {seed}"
    assert together[1::2] == run(tok_llm, controlled_), f"seed {seed}: controlled rows depend on the batch"
    tok_llm.core.assert_idle_and_clean()


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_speculation_keeps_the_outputs(tiny_dir, tok_llm, proposer):
    """A speculating engine gives the same tokens (position-dependent rows do not speculate; logit_bias and
    allowed_token_ids rows do, and verification applies them exactly), on repetitive prompts. The target as its own
    draft proposes what it would sample, so a penalised row that speculated would have proposals accepted where
    its penalties are wrong."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    config = dict(method="ngram", prompt_lookup_min=1) if proposer == "ngram" else \
        dict(method="draft_model", model=tiny_dir)
    spec = make_llm(tiny_dir, speculative_config=dict(num_speculative_tokens=3, adaptive=False, **config))
    spec.tokenizer = tok_llm.tokenizer
    pattern = rng.integers(0, VOCAB, 4).tolist()
    requests = [({"prompt_token_ids": (pattern * 10)[:n]}, SamplingParams(
        temperature=t, seed=3, max_tokens=20, ignore_eos=True, **CONTROLS[name](tok_llm.tokenizer)))
        for n, t, name in zip((9, 17, 30, 13, 22), (0, 0.8, 0, 0, 1.0), sorted(CONTROLS))]
    requests += [({"prompt_token_ids": (pattern * 10)[:15]}, SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logit_bias={pattern[0]: 5.0}, allowed_token_ids=pattern))]
    assert run(spec, requests) == run(tok_llm, requests), f"seed {seed}"
    assert spec.stats().spec_decode_num_draft_tokens > 0  # the biased, masked row speculated
    spec.core.assert_idle_and_clean()


# ---- the server ----

def test_the_server_applies_every_control(tiny_dir):
    """Completions (OpenAI's logit_bias keys are strings) and chat through the official client (vLLM's extensions
    in extra_body): the text offline generation gives with the same params."""
    from openai import OpenAI

    from serving import ServerThread
    llm = make_llm(tiny_dir, max_model_len=64)
    llm.tokenizer = byte_tokenizer()
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    allowed = letters(llm.tokenizer, "bcdefghi")
    params = dict(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                  repetition_penalty=1.3, logit_bias={allowed[2]: 3.0, allowed[5]: -2.0}, allowed_token_ids=allowed,
                  bad_words=["de", "f"])
    want = {prompt: llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
            for prompt in ("bcdbcd", "ghi")}
    assert all(want.values()) and not any("de" in t or "f" in t for t in want.values())
    body = {**params, "logit_bias": {str(t): b for t, b in params["logit_bias"].items()}}
    st = ServerThread(llm, "tiny")
    try:
        c = OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        vllm_only = ("repetition_penalty", "allowed_token_ids", "bad_words", "ignore_eos")
        r = c.completions.create(model="tiny", prompt="bcdbcd", extra_body={k: body[k] for k in vllm_only},
                                 **{k: v for k, v in body.items() if k not in vllm_only})
        assert r.choices[0].text == want["bcdbcd"]
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ghi"}],
                                      extra_body={k: body[k] for k in vllm_only},
                                      **{k: v for k, v in body.items() if k not in vllm_only})
        assert r.choices[0].message.content == want["ghi"]
        r = post_json(st.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "bad_words": ["b"] * 65})
        assert r[0] == 400 and r[1]["error"]["param"] == "bad_words"
    finally:
        st.stop()
    llm.core.assert_idle_and_clean()


def post_json(url, body):
    import json
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
