"""Speculative decoding in the engine: proposers, verification rows in the ragged step, rollback, the controller.

The verification rule itself is tested in test_verification.py; here, that the engine around it emits what
plain decoding would (token for token, greedy or seeded), leaks no page, and switches itself on and off.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.batching.speculation.controller import PROBE_EVERY, SpecController, expected_tokens
from jaxserve.batching.speculation.ngram import NgramIndex
from jaxserve.spec_config import SpeculativeConfig

from tiny import TINY_PAGE_BYTES, make_llm, prompts

VOCAB = 320
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def spec(method, k=3, **kw):
    return dict(method=method, num_speculative_tokens=k, adaptive=False, **kw)


def mixed_prompts(rng):
    """Repetitive prompts (n-gram hits), random ones, and two sharing a 12-token prefix (prefix-cache hits)."""
    pattern = rng.integers(0, VOCAB, 5).tolist()
    shared = rng.integers(0, VOCAB, 12).tolist()
    return [{"prompt_token_ids": (pattern * 8)[:n]} for n in (7, 23, 31)] + prompts(rng, [2, 9, 17]) + \
        [{"prompt_token_ids": shared + rng.integers(0, VOCAB, n).tolist()} for n in (3, 6)]


def tokens(llm, ps, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]


# float32 logits of one position computed in a verification row and in a plain decode row differ in their last
# bits (another summation order): greedy tokens may part only where the plain run's best two were this close.
NEAR_TIE = 1e-4


def plain_with_margins(llm, ps):
    """Plain greedy tokens, and per position the gap between the best two logprobs."""
    outs = llm.generate(ps, dataclasses.replace(GREEDY, logprobs=2), use_tqdm=False)
    margins = [[abs(float(np.subtract(*sorted((v.logprob for v in top.values()), reverse=True)[:2])))
                for top in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], margins


def assert_greedy_equal(got, plain, margins, message):
    """got equals plain, or parts from it first where plain's best two were a near-tie (then the rest may differ)."""
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert j < len(b) and margins[i][j] < NEAR_TIE, (
                f"{message}: prompt {i} parts from plain decoding at token {j}, where plain's best two differ by "
                f"{margins[i][j] if j < len(b) else 'n/a'} (not a near-tie)")


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_greedy_speculation_gives_the_plain_tokens(tiny_dir, other_tiny_dir, proposer):
    """Mixed batches (speculating rows beside plain decodes and prompt chunks), pages of 4 tokens, 8 prompts for
    4 slots, prefix hits; a perfect draft (the target itself), a bad one, and prompt lookup."""
    seed = int(np.random.default_rng().integers(2**31))
    ps = mixed_prompts(np.random.default_rng(seed))
    config = {"ngram": spec("ngram", prompt_lookup_min=1), "draft-self": spec("draft_model", model=tiny_dir),
              "draft-other": spec("draft_model", model=other_tiny_dir)}[proposer]
    plain, margins = plain_with_margins(make_llm(tiny_dir), ps)
    llm = make_llm(tiny_dir, speculative_config=config)
    assert_greedy_equal(tokens(llm, ps), plain, margins, f"seed {seed}")
    assert_greedy_equal(tokens(llm, ps), plain, margins, f"seed {seed} (again, from the prefix cache)")
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if proposer == "draft-self":  # the target proposing for itself is always right
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if proposer == "draft-other":
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    llm.core.assert_idle_and_clean()


def test_stops_inside_an_accepted_run(tiny_dir):
    """A stop token or max_tokens that falls inside a run of accepted proposals ends the output right there."""
    rng = np.random.default_rng()
    ps = prompts(rng, [5, 11])
    plain_llm, llm = make_llm(tiny_dir), make_llm(tiny_dir, speculative_config=spec("draft_model", 4, model=tiny_dir))
    full = tokens(plain_llm, ps)
    for i, out in enumerate(full):
        stop = out[6]  # the first time it appears ends the output (mid-run: proposals come 4 at a time)
        sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)
        got = llm.generate(ps[i], sp, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == out[:out.index(stop) + 1] and got.finish_reason == "stop"
    for n in (1, 3, 7, 13):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert tokens(llm, ps, sp) == [out[:n] for out in full]
    llm.core.assert_idle_and_clean()


def test_preemption_mid_speculation(tiny_dir):
    """A KV cache too small for every sequence: speculating sequences are preempted and recomputed."""
    seed = int(np.random.default_rng().integers(2**31))
    ps = prompts(np.random.default_rng(seed), [9, 14, 20, 6])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens(make_llm(tiny_dir, kv_cache_memory_bytes=17 * TINY_PAGE_BYTES, max_model_len=48), ps, sp)
    for config, cost in ((spec("draft_model", model=tiny_dir), 2), (spec("ngram", prompt_lookup_min=1), 1)):
        # 16 pages of 4 tokens, where 4 sequences reach 44 tokens (a page costs twice as much with a draft).
        llm = make_llm(tiny_dir, speculative_config=config, kv_cache_memory_bytes=17 * cost * TINY_PAGE_BYTES,
                       max_model_len=48)
        assert tokens(llm, ps, sp) == plain, f"seed {seed}, {config['method']}"
        assert llm.stats().num_preemptions > 0, f"seed {seed}"
        llm.core.assert_idle_and_clean()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_dir):
    rng = np.random.default_rng()
    ps = prompts(rng, [4, 12, 7])
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=1234, ignore_eos=True)
    llm = make_llm(tiny_dir, speculative_config=spec("draft_model", model=tiny_dir))
    together = tokens(llm, ps, sp)
    alone = [tokens(llm, [p], sp)[0] for p in ps]
    assert together == alone
    # The draft is the target and draws with the target's keys, so its proposals are the target's own draws and
    # are all accepted (drawn with keys of their own, they would match only by chance): the coupling is wired.
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens >= 0.97 * stats.spec_decode_num_draft_tokens > 0, stats


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_seeded_sampling_gives_the_plain_text_when_speculating(tiny_dir, other_tiny_dir, proposer):
    """The README's promise: the same seed gives the same text whatever else is batched, so whether a sequence
    speculates (which the adaptive controller decides from the batch) must not change it either. Every filter is
    in play, and a ban (min_tokens)."""
    # A fixed seed: the tiny model's logits differ in the last bit between batch shapes, which may (rarely) flip a
    # draw of plain sampling itself (see BENCHMARKS.md); a random seed would make that a flaky failure.
    seed = 20261201
    rng = np.random.default_rng(seed)
    ps = mixed_prompts(rng)
    sps = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp, seed=int(rng.integers(2**31)), max_tokens=30,
                          min_tokens=3, ignore_eos=True)
           for t, k, tp, mp in [(0.7, 0, 1.0, 0.0), (1.0, 20, 0.9, 0.0), (0.5, 0, 0.8, 0.05), (1.2, 5, 1.0, 0.1)]]
    sps = [sps[i % len(sps)] for i in range(len(ps))]
    config = {"ngram": spec("ngram", prompt_lookup_min=1), "draft-self": spec("draft_model", model=tiny_dir),
              "draft-other": spec("draft_model", model=other_tiny_dir)}[proposer]
    plain = tokens(make_llm(tiny_dir), ps, sps)
    llm = make_llm(tiny_dir, speculative_config=config)
    assert tokens(llm, ps, sps) == plain, f"seed {seed}"
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0, f"seed {seed}: {stats}"
    if proposer == "draft-self":  # its proposals are the target's own draws: kept, so accepted runs are covered
        assert stats.spec_decode_num_accepted_tokens >= 0.97 * stats.spec_decode_num_draft_tokens, f"seed {seed}"
    llm.core.assert_idle_and_clean()


def test_sampled_tokens_follow_the_targets_distribution(tiny_dir, other_tiny_dir):
    """The second and third tokens (the first ones a verification emits) of many seeded samples, with and without
    a (bad) draft: the same distribution. The exactness proof is in test_verification.py; this catches wiring
    (positions, steps, keys)."""
    p = {"prompt_token_ids": [5, 17, 99, 3]}
    sp = SamplingParams(n=300, temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=7)
    draws = []
    for config in (None, spec("draft_model", 2, model=other_tiny_dir)):
        llm = make_llm(tiny_dir, max_num_seqs=32, max_num_batched_tokens=128, speculative_config=config)
        outs = llm.generate(p, sp, use_tqdm=False)[0].outputs
        draws.append([tuple(o.token_ids[1:3]) for o in outs])
    keys = sorted(set(draws[0]) | set(draws[1]))
    a = np.array([draws[0].count(k) for k in keys], float)
    b = np.array([draws[1].count(k) for k in keys], float)
    tv = 0.5 * np.abs(a / a.sum() - b / b.sum()).sum()
    # Two samples of 300 over at most 16 outcomes: the total-variation distance of equal distributions stays below
    # ~0.2 (a wiring fault, e.g. a step off by one, moves it far beyond).
    assert tv < 0.22, (tv, keys, a, b)


def test_bad_configurations_are_refused(tiny_dir):
    for bad, message in [(dict(method="medusa", num_speculative_tokens=2), "method"),
                         (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
                         (dict(method="draft_model", num_speculative_tokens=2), "draft model"),
                         (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
                          "prompt_lookup"),
                         (dict(method="ngram", num_speculative_tokens=2, typo=1), "unknown"),
                         (dict(method="ngram"), "needs")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_value(bad)


def test_a_draft_with_another_tokenizer_is_refused():
    from jaxserve.engine.speculation import check_same_tokenizer

    class Chars:
        def __init__(self, shift):
            self.shift = shift

        def encode(self, text):
            return [ord(c) + self.shift for c in text]
    check_same_tokenizer(Chars(0), Chars(0))
    check_same_tokenizer(None, Chars(0))  # a model without a tokenizer (token-id prompts only) has nothing to compare
    with pytest.raises(ValueError, match="tokenizer"):
        check_same_tokenizer(Chars(1), Chars(0))


@pytest.mark.parametrize("change, message", [(dict(vocab_size=256), "vocabulary"),
                                             (dict(max_position_embeddings=64), "context")])
def test_a_draft_that_cannot_serve_the_target_is_refused(tiny_dir, tmp_path, change, message):
    from hf_models import TINY, VARIANTS
    config_cls, model_cls, extra = VARIANTS["llama"]
    model_cls(config_cls(**{**TINY, **extra, **change})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):  # the target's sequences reach max_model_len = 96 tokens
        make_llm(tiny_dir, speculative_config=spec("draft_model", model=str(tmp_path)))


def test_speculation_switches_itself_off_when_proposals_are_rejected(tiny_dir, other_tiny_dir):
    """A draft that is mostly wrong, under the adaptive controller: after a few tries it stops asking."""
    llm = make_llm(tiny_dir, speculative_config=dict(method="draft_model", model=other_tiny_dir,
                                                     num_speculative_tokens=3))
    # Fixed step costs (a memory-bound device's: a verification 1.2x a plain step, a draft step 0.2x), so that only
    # measured acceptance decides: timed on a loaded machine, the costs alone could keep it on or off.
    controller = llm.core.controller
    for key in controller.target_times:
        controller.target_times[key] = 1.2 if key[1] > 1 else 1.0
    for key in controller.draft_times:
        controller.draft_times[key] = 0.2
    controller.observe_step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    controller.observe_host = lambda *args, **kwargs: None  # type: ignore[method-assign]
    ps = prompts(np.random.default_rng(), [5, 9])
    plain = tokens(make_llm(tiny_dir), ps, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    assert tokens(llm, ps, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)) == plain
    stats = llm.stats()
    assert stats.spec_decode_num_drafts < stats.steps / 4, stats


# ---- the n-gram lookup ----

def scan_ngram(tokens, k, max_n, min_n):
    """The plain way: scan back for the latest earlier occurrence of the last n tokens, n from max_n down."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []


def propose_ngram(tokens, k, max_n, min_n):
    index = NgramIndex(max_n, min_n)
    index.tokens += tokens
    return index.lookup(k)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), cut=st.integers(1, 60),
       k=st.integers(1, 5), lo=st.integers(1, 3), extra=st.integers(0, 3))
def test_the_ngram_index_finds_what_a_scan_finds(tokens, cut, k, lo, extra):
    """The incremental index, fed the sequence in two parts (as it grows), against the plain scan."""
    hi = lo + extra
    index = NgramIndex(hi, lo)
    index.tokens += tokens[:cut]
    index.lookup(k)
    index.tokens += tokens[cut:]
    assert index.lookup(k) == scan_ngram(tokens, k, hi, lo)


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 3, 1) == [7, 8]  # the latest of two matches
    assert propose_ngram([5, 6, 1, 2, 4, 6, 1, 2], 3, 3, 2) == [4, 6, 1]  # longest n first: [6, 1, 2] then
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []  # no earlier occurrence
    assert propose_ngram([7, 7, 7], 4, 2, 1) == [7]  # [7, 7] occurs at 0, and only one token follows it
    assert propose_ngram([3], 2, 3, 1) == []


# ---- the controller, on measured-looking costs ----

class Seq:
    pass


def memory_bound(k):
    """Step times of a memory-bound device: flat up to 64 tokens, then compute-bound (linear)."""
    buckets = (1, 4, 8, 16, 32, 64, 128, 256)
    return buckets, {(t, q): 0.010 * max(1.0, t / 64) * (1.02 if q > 1 else 1.0)
                     for t in buckets for q in (1, k + 1)}


def controller(k=4, draft_cost=None):
    buckets, times = memory_bound(k)
    draft = None if draft_cost is None else {(t, 1): draft_cost for t in buckets}
    return SpecController(k, buckets, times, draft)


def train(c, seq, accepted, proposed, times=20):
    for _ in range(times):
        c.observe(seq, proposed, accepted)


def test_controller_speculates_where_proposals_are_accepted():
    c = controller()
    good, bad = Seq(), Seq()
    train(c, good, 4, 4)
    train(c, bad, 0, 4)
    chosen = c.choose([good, bad], lambda s: None)
    assert chosen.get(good, 0) >= 3 and bad not in chosen


def test_controller_turns_off_on_random_text_and_at_large_batches():
    c = controller()
    seqs = [Seq() for _ in range(3)]
    for s in seqs:
        train(c, s, 0, 4)
    assert c.choose(seqs, lambda s: None) == {}
    # A compute-bound batch: every proposal costs a full token, so even perfect acceptance does not pay enough.
    c = controller()
    seqs = [Seq() for _ in range(100)]
    for s in seqs:
        train(c, s, 4, 4)
    assert c.choose(seqs, lambda s: None) == {}


def test_controller_weighs_a_draft_models_cost():
    seq = Seq()
    cheap, dear = controller(draft_cost=0.001), controller(draft_cost=0.008)
    for c in (cheap, dear):
        train(c, seq, 2, 4)  # acceptance ~0.67: worth it only when drafting is cheap
    assert cheap.choose([seq], lambda s: None) and not dear.choose([seq], lambda s: None)


def test_controller_reprobes_a_sequence_it_switched_off():
    c, seq = controller(), Seq()
    train(c, seq, 0, 4)
    for _ in range(PROBE_EVERY):
        assert c.choose([seq], lambda s: None) == {}
    assert c.choose([seq], lambda s: None)  # back to the prior: worth another try


def test_controller_only_asks_for_what_the_proposer_has():
    c, seq = controller(), Seq()
    train(c, seq, 4, 4)
    assert c.choose([seq], lambda s: [1, 2]) == {seq: 2}
    assert c.choose([seq], lambda s: []) == {}


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


# ---- the default model ----

COPY_PROMPT = [{"role": "user", "content": "Repeat this code exactly, with no comment:\n\ndef area(width, height):\n"
                                           "    result = width * height\n    return result\n\n"
                                           "def perimeter(width, height):\n    return 2 * (width + height)\n"}]


@pytest.fixture(scope="module")
def default_spec_llm():
    from jaxserve import LLM
    # Not adaptive: whether speculation pays depends on this machine's measured step times (the controller's
    # decisions are tested on fixed costs above); this test is about the real model's text. Compiled on first use:
    # only the shapes this prompt takes (warm-up compiles every bucket, each a 30-layer program).
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=16,
               speculative_config=spec("ngram", k=4), warmup=False)


def test_default_model_copying_speculates_and_gives_the_plain_text(default_llm, default_spec_llm):
    """N-gram speculation on a prompt whose answer copies it: most proposals are accepted, and the text (a stop
    string landing inside an accepted run included) is plain greedy's."""
    llm = default_spec_llm
    for sp in (SamplingParams(temperature=0, max_tokens=60),
               SamplingParams(temperature=0, max_tokens=60, stop=["2 * (width"])):
        before = llm.stats()
        want = default_llm.chat(COPY_PROMPT, sp, use_tqdm=False)[0].outputs[0]
        got = llm.chat(COPY_PROMPT, sp, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        after = llm.stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        assert drafted > 0 and accepted / drafted > 0.6, (drafted, accepted)
    llm.core.assert_idle_and_clean()

