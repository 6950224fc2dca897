"""scripts/train_eagle3.py on a tiny random Llama: the target's generations and captured features, the draft
vocabulary, the training-time test's chain attention against the head run step by step as the engine chains it,
a few optax steps that lower the loss, and a head written in the speculators layout that load_head reads back."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import train_draft as td  # noqa: E402
import train_eagle3 as te  # noqa: E402

from jaxserve.cache import init_kv_cache  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402
from jaxserve.weights.eagle3 import load_head  # noqa: E402

from tiny import make_llm  # noqa: E402


def tiny_data(tiny_dir, seed: int, num_prompts: int = 8, max_tokens: int = 12):
    rng = np.random.default_rng(seed)
    prompts = [{"kind": "chat", "prompt_token_ids": rng.integers(0, 320, int(n)).tolist()}
               for n in rng.integers(3, 14, num_prompts)]
    seqs = td.generate_data(make_llm(tiny_dir), prompts, max_tokens=max_tokens, temperature=0.0, seed=seed)
    target = load_model(tiny_dir, jnp.float32)
    capture = te.feature_layers_for(target.config.num_layers)
    return target, capture, te.capture_data(target.config, target.params, seqs, capture, bucket=16)


def test_captures_features_and_the_engines_greedy_tokens(tiny_dir, tmp_path):
    target, capture, seqs = tiny_data(tiny_dir, seed=3)
    assert capture == (0, 1, 2)
    for s in seqs:
        n, p = len(s["tokens"]), s["prompt_len"]
        assert s["features"].shape == (n, 3 * target.config.hidden_size) and s["features"].dtype == np.float16
        # the capture pass's argmax is what the engine generated greedily (seed 3)
        np.testing.assert_array_equal(s["labels"][p - 1:n - 1], s["tokens"][p:], err_msg="seed 3")
    te.save_data(tmp_path / "d.npz", seqs)
    back = te.load_data(tmp_path / "d.npz")
    for a, b in zip(seqs, back):
        np.testing.assert_array_equal(a["features"], b["features"])
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        assert a["prompt_len"] == b["prompt_len"]


def test_draft_vocabulary_takes_the_most_frequent_targets():
    seqs = [{"prompt_len": 1, "labels": np.array([9, 5, 5, 7, 7, 7, 3])}]
    ids, d2t, coverage = te.choose_draft_vocab(seqs, vocab_size=12, size=3)
    # counts after the prompt: 7 x3, 5 x2, then 3 and 9 once each: the lower id (3) wins the tie
    np.testing.assert_array_equal(ids, [3, 5, 7])
    np.testing.assert_array_equal(np.arange(3) + d2t, ids)
    assert coverage == 6 / 7


def test_training_time_test_is_the_engines_chain(tiny_dir):
    """Unroll step j at position i equals the head run as the engine chains it: step 1 over positions 0 .. p from
    the target's features, then one token at a time with the previous output as hidden, over a cache of the
    chain's own keys."""
    rng = np.random.default_rng(7)
    target = load_model(tiny_dir, jnp.float32)
    config = te.make_head_config(target.config, (0, 1, 2), 40)
    params = te.init_head(config, target.params, np.arange(0, 320, 8), seed=7)
    model = te.Eagle3Head(config, jnp.float32, "dense")
    T, S = 10, 3
    tokens = jnp.asarray(rng.integers(0, 320, T), jnp.int32)
    features = jnp.asarray(rng.normal(size=(T, config.feature_size)), jnp.float32)
    positions = jnp.arange(T, dtype=jnp.int32)
    unrolled = te.head_unroll(model, params, tokens, features, positions, jnp.asarray(te.chain_page_tables(T, S)), S)
    for p in (0, 3, T - S):
        n = p + 1
        _, out, kv = model.apply(params, tokens[:n], features[:n], jnp.zeros((n, config.hidden_size)),
                                 jnp.ones(n, bool), init_kv_cache(config.layer_config(), 1, 1, jnp.float32),
                                 te.step_one_rows(positions[:n]))
        keys, values, hidden = [kv[0][0]], [kv[0][1]], out[-1:]
        for j in range(1, S):
            i = p + j
            pages = [(jnp.concatenate(keys)[:, :, None], jnp.concatenate(values)[:, :, None])]
            rows = te.RaggedRows(positions=jnp.array([i], jnp.int32), token_row=jnp.zeros(1, jnp.int32),
                                 query_start=jnp.array([0, 1], jnp.int32), cached_lens=jnp.array([i], jnp.int32),
                                 page_table=jnp.arange(i, dtype=jnp.int32)[None])
            logits, hidden, kv = model.apply(params, tokens[i:i + 1], features[i:i + 1], hidden, jnp.zeros(1, bool),
                                             pages, rows)
            keys.append(kv[0][0])
            values.append(kv[0][1])
            np.testing.assert_allclose(unrolled[j, i], logits[0], atol=2e-5, rtol=2e-5,
                                       err_msg=f"seed 7, chain from {p}, step {j + 1}")


def test_chain_attention_unrolls_as_the_paged_chain(tiny_dir):
    """The training path (chain_attention: one [T, T] matmul and diagonal terms) gives the unroll of the engine's
    paged attention over chain_page_tables, padding included, at every valid position of every step."""
    rng = np.random.default_rng(11)
    target = load_model(tiny_dir, jnp.float32)
    config = te.make_head_config(target.config, (0, 1, 2), 40)
    params = te.init_head(config, target.params, np.arange(0, 320, 8), seed=11)
    params = jax.tree.map(lambda x: x + 0.05 * jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    T, S, n = 12, 4, 9  # positions n .. T - 1 are padding
    tokens = jnp.asarray(rng.integers(0, 320, T), jnp.int32)
    features = jnp.asarray(rng.normal(size=(T, config.feature_size)), jnp.float32)
    positions = jnp.asarray(np.where(np.arange(T) < n, np.arange(T), -1), jnp.int32)
    paged = te.head_unroll(te.Eagle3Head(config, jnp.float32, "dense"), params, tokens, features, positions,
                           jnp.asarray(te.chain_page_tables(T, S)), S)
    fast = te.head_unroll(te.Eagle3Head(config, jnp.float32, attend=te.chain_attention), params, tokens, features,
                          positions, None, S)
    for j in range(S):
        np.testing.assert_allclose(fast[j, j:n], paged[j, j:n], atol=2e-5, rtol=2e-5, err_msg=f"seed 11, step {j}")


def test_trains_a_head_that_writes_and_reads_back(tiny_dir, tmp_path):
    target, capture, seqs = tiny_data(tiny_dir, seed=0, num_prompts=8, max_tokens=16)
    ids, d2t, _ = te.choose_draft_vocab(seqs, 320, 64)
    t2d = np.full(320, -1, np.int32)
    t2d[ids] = np.arange(64)
    config = te.make_head_config(target.config, capture, 64)
    params = te.init_head(config, target.params, ids, seed=0)
    np.testing.assert_array_equal(params["params"]["lm_head"]["kernel"],
                                  np.asarray(target.params["params"]["lm_head"]["kernel"])[:, ids])
    optimizer = optax.adam(3e-3)
    train_step, eval_step = te.make_steps(config, optimizer, num_steps=3, seq_len=32)
    before = te.evaluate(eval_step, params, seqs, ids, t2d, 32, 4, 3)
    trained, losses = te.train(train_step, optimizer, params, seqs, t2d, 32, 4, steps=30, seed=0, log_every=100)
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    after = te.evaluate(eval_step, trained, seqs, ids, t2d, 32, 4, 3)
    assert before["positions"] == after["positions"] == sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
    assert after["agreement"][0] > before["agreement"][0], (before, after)
    assert after["chain_acceptance"][0] >= after["chain_acceptance"][1] >= after["chain_acceptance"][2]

    te.write_head(tmp_path / "head", config, trained, d2t, tiny_dir, 3)
    back = load_head(tmp_path / "head", target.config)
    assert back.config == config
    np.testing.assert_array_equal(back.d2t, d2t)
    want = {k: v for k, v in trained["params"].items() if k != "embed_tokens"}  # the engine uses the target's
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), back.params["params"], want)
    assert all(jax.tree.leaves(same))


def test_prompts_and_the_held_out_split_cover_every_kind():
    prompts = te.make_prompts(64, seed=0)
    assert prompts == te.make_prompts(64, seed=0) and prompts != te.make_prompts(64, seed=1)
    held = [p for i, p in enumerate(prompts) if te.held_out(i)]
    assert len(held) == 8 and {p["kind"] for p in held} == set(te.KINDS)
    assert {p["kind"] for i, p in enumerate(prompts) if not te.held_out(i)} == set(te.KINDS)
