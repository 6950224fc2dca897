"""EAGLE-3 in the engine: a head over the target's captured hidden states proposes, the target verifies.

Random heads (tests/eagle3_heads.py) in both public layouts: whatever a head proposes, the text is plain decoding's
(greedy, and seeded sampling token for token), and the proposals are the head's own: the same chain a dense
forward of the head over the whole sequence gives (positions, the token shift, the features read, the chain's
hidden states), through chunked prompts, prefix hits, preemption and aborts.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.cache import init_kv_cache
from jaxserve.model.decoder import DecoderModel
from jaxserve.model.eagle3 import Eagle3Head, to_target_vocab
from jaxserve.weights import load_model
from jaxserve.weights.eagle3 import load_head

from eagle3_heads import write_tiny_head
from head_chains import dense_rows, recorded_proposals
from tiny import TINY_PAGE_BYTES, make_llm, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def eagle(head_dir, k=3, **kw):
    return dict(method="eagle3", model=head_dir, num_speculative_tokens=k, adaptive=False, **kw)


@pytest.fixture(scope="module")
def target_config(tiny_dir):
    return load_model(tiny_dir, "float32").config


@pytest.fixture(scope="module", params=["speculators", "eagle3"])
def head_dir(request, tiny_dir, target_config, tmp_path_factory):
    return write_tiny_head(tmp_path_factory.mktemp(f"head-{request.param}"), target_config, request.param, seed=3)


def tokens(llm, ps, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]


def mixed(rng):
    shared = rng.integers(0, 320, 12).tolist()
    return prompts(rng, [2, 9, 17, 30]) + [{"prompt_token_ids": shared + rng.integers(0, 320, n).tolist()}
                                           for n in (3, 6)]


def reference_chain(tiny_dir, head_dir, seq_tokens, k):
    """The head's greedy proposals after seq_tokens, by dense forwards over whole sequences (no pages, no catch-up):
    the target's features at positions 0 .. N-2; head position i reads token i + 1 and feature i, and each chained
    position the head's own output at the position before."""
    target = load_model(tiny_dir, "float32")
    head = load_head(head_dir, target.config, np.float32)
    hc, n = head.config, len(seq_tokens) - 1
    cache = init_kv_cache(target.config, 2, 4, jnp.float32)
    ids = jnp.asarray(seq_tokens[:n], jnp.int32)
    *_, features = DecoderModel(target.config, attention_backend="dense").apply(
        target.params, ids, cache, dense_rows(n), return_hidden=True, capture=hc.feature_layers)
    params = {"params": {"embed_tokens": target.params["params"]["embed_tokens"], **head.params["params"]}}
    model, head_cache = Eagle3Head(hc, attention_backend="dense"), init_kv_cache(hc.layer_config(), 2, 4, jnp.float32)
    toks, hidden, proposals = list(seq_tokens[1:]), np.zeros((n, hc.hidden_size), np.float32), []
    feats = np.asarray(features)
    for j in range(k):
        L = n + j
        from_target = np.arange(L) < n
        f = np.concatenate([feats, np.zeros((j, feats.shape[1]), np.float32)])
        logits, out, _ = model.apply(params, jnp.asarray(toks, jnp.int32), jnp.asarray(f), jnp.asarray(hidden),
                                     jnp.asarray(from_target), head_cache, dense_rows(L))
        full = to_target_vocab(logits[-1], jnp.asarray(head.d2t), hc.vocab_size)
        proposals.append(int(jnp.argmax(full)))
        toks.append(proposals[-1])
        hidden = np.concatenate([hidden, np.asarray(out[-1:])])  # the next position's hidden input
    return proposals


def test_greedy_text_is_plain_decodings(tiny_dir, head_dir):
    seed = int(np.random.default_rng().integers(2**31))
    ps = mixed(np.random.default_rng(seed))
    plain = tokens(make_llm(tiny_dir), ps)
    llm = make_llm(tiny_dir, speculative_config=eagle(head_dir))
    assert tokens(llm, ps) == plain, f"seed {seed}"
    assert tokens(llm, ps) == plain, f"seed {seed} (again, from the prefix cache)"
    assert llm.stats().spec_decode_num_draft_tokens > 0
    llm.core.assert_idle_and_clean()


def test_proposals_are_the_heads_chain(tiny_dir, head_dir):
    """Every proposal the engine verified equals a dense forward's of the head, for sequences of every length
    (prompt chunks of 16 tokens, so a long prompt's features arrive over several steps)."""
    seed = int(np.random.default_rng().integers(2**31))
    ps = prompts(np.random.default_rng(seed), [3, 21, 40])
    llm = make_llm(tiny_dir, speculative_config=eagle(head_dir, k=3))
    seen = recorded_proposals(llm, ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) > 10
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(seen), 6, replace=False):
        seq, proposed = seen[i]
        assert proposed == reference_chain(tiny_dir, head_dir, seq, len(proposed)), f"seed {seed}, {len(seq)} tokens"


def test_seeded_sampling_gives_the_plain_text(tiny_dir, head_dir):
    seed = 20261207  # fixed: see test_speculative's test of the same name
    rng = np.random.default_rng(seed)
    ps = mixed(rng)
    sps = [SamplingParams(temperature=t, top_k=k, top_p=tp, seed=int(rng.integers(2**31)), max_tokens=24,
                          ignore_eos=True) for t, k, tp in [(0.7, 0, 1.0), (1.0, 20, 0.9), (0.5, 0, 0.8)]]
    sps = [sps[i % len(sps)] for i in range(len(ps))]
    plain = tokens(make_llm(tiny_dir), ps, sps)
    llm = make_llm(tiny_dir, speculative_config=eagle(head_dir))
    assert tokens(llm, ps, sps) == plain, f"seed {seed}"
    assert llm.stats().spec_decode_num_draft_tokens > 0
    llm.core.assert_idle_and_clean()


def test_preemption_and_aborts_mid_chain(tiny_dir, head_dir, target_config):
    """A cache too small for every sequence (preempted and recomputed, the head's cache and features with them),
    then requests aborted while their proposals are in flight: the same text, no page leaked."""
    seed = int(np.random.default_rng().integers(2**31))
    ps = prompts(np.random.default_rng(seed), [9, 14, 20, 6])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens(make_llm(tiny_dir, kv_cache_memory_bytes=17 * TINY_PAGE_BYTES, max_model_len=48), ps, sp)
    # A page id costs the target's page, the head's and the page's features: about twice the target's alone here.
    llm = make_llm(tiny_dir, speculative_config=eagle(head_dir), kv_cache_memory_bytes=40 * TINY_PAGE_BYTES,
                   max_model_len=48)
    assert llm.runner.steps.capture and llm.scheduler.cache.allocator.num_free < 24
    assert tokens(llm, ps, sp) == plain, f"seed {seed}"
    assert llm.stats().num_preemptions > 0, f"seed {seed}"
    for i, p in enumerate(ps):
        llm.add_request(p, sp, request_id=f"abort-{i}")
    for _ in range(5):
        llm.step()
    for i in range(len(ps)):
        llm.abort_request(f"abort-{i}")
    while llm.has_unfinished_requests():
        llm.step()
    llm.core.assert_idle_and_clean()


def test_a_head_for_another_target_is_refused(tiny_dir, target_config, tmp_path):
    import dataclasses
    other = dataclasses.replace(target_config, hidden_size=32, num_heads=2, num_kv_heads=1)
    bad = write_tiny_head(tmp_path / "h", other, "speculators", seed=1)
    with pytest.raises(ValueError, match="target_hidden_size|hidden"):
        make_llm(tiny_dir, speculative_config=eagle(bad))
    with pytest.raises(ValueError, match="kv_offloading_size"):
        make_llm(tiny_dir, speculative_config=eagle(bad), kv_offloading_size=0.01)


def test_sampled_tokens_follow_the_targets_distribution(tiny_dir, head_dir):
    """The second and third tokens (the first a verification emits) of many seeded samples, with and without the
    head: the same distribution (the exactness proof is test_verification.py's; this catches wiring)."""
    p = {"prompt_token_ids": [5, 17, 99, 3]}
    sp = SamplingParams(n=300, temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=11)
    draws = []
    for config in (None, eagle(head_dir, 2)):
        llm = make_llm(tiny_dir, max_num_seqs=32, max_num_batched_tokens=128, speculative_config=config)
        draws.append([tuple(o.token_ids[1:3]) for o in llm.generate(p, sp, use_tqdm=False)[0].outputs])
    keys = sorted(set(draws[0]) | set(draws[1]))
    a, b = (np.array([d.count(k) for k in keys], float) for d in draws)
    tv = 0.5 * np.abs(a / a.sum() - b / b.sum()).sum()
    assert tv < 0.22, (tv, keys, a, b)  # as test_speculative's: two samples of 300 over at most 16 outcomes
