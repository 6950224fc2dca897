"""Smoke test of scripts/train_draft.py on a tiny random Llama: data from the engine, a few optax steps that lower
the KL, and a checkpoint that load_model reads back."""
import sys

import jax.numpy as jnp
import numpy as np

from locations import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import train_draft as td  # noqa: E402

from jaxserve.weights import load_model  # noqa: E402

from tiny import make_llm  # noqa: E402


def test_distils_a_draft_that_loads(tiny_dir, tmp_path):
    rng = np.random.default_rng(0)
    prompts = [{"kind": "raw", "prompt_token_ids": rng.integers(0, 320, n).tolist()} for n in (5, 9, 7, 12)]
    seqs = td.generate_data(make_llm(tiny_dir), prompts, max_tokens=12, temperature=0.8, seed=0)
    assert all(len(s["tokens"]) == s["prompt_len"] + 12 for s in seqs)

    target = load_model(tiny_dir, jnp.float32)
    config, params, chosen = td.init_draft(target.config, target.params, 1)
    assert chosen == [1] and config.num_layers == 1
    np.testing.assert_array_equal(params["params"]["layers_0"]["q_proj"]["kernel"],
                                  target.params["params"]["layers_1"]["q_proj"]["kernel"])
    draft_model = td.DecoderModel(config, jnp.float32, "dense")
    target_model = td.DecoderModel(target.config, jnp.float32, "dense")
    optimizer, _ = td.make_optimizer(lr=1e-2, steps=8, warmup=1)
    step = td.make_train_step(draft_model, target_model, optimizer)
    trained, losses = td.train(step, optimizer, params, target.params, seqs, seq_len=32, batch_size=4, steps=8,
                               seed=0, log_every=100)
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses

    eval_step = td.make_eval_step(draft_model, target_model)
    before = td.evaluate(eval_step, params, target.params, seqs, 32, 4)
    after = td.evaluate(eval_step, trained, target.params, seqs, 32, 4)
    assert after["kl"] < before["kl"] and before["positions"] == 4 * 12

    td.save_draft(tmp_path / "draft", config, trained, None)
    td.check_checkpoint(tmp_path / "draft", config, trained, run_llm=False)
    assert load_model(str(tmp_path / "draft"), jnp.float32).config.num_layers == 1


def test_training_forward_matches_the_engine(tiny_dir):
    """The training forward (a row per sequence, empty cache, dense attention, vmapped over padded sequences) gives
    the engine's logits; a draft with every layer is the target."""
    from jaxserve.cache import init_kv_cache
    from jaxserve.runner.batch_builder import Row, build_batch
    from jaxserve.runner.steps import Steps
    target = load_model(tiny_dir, jnp.float32)
    prompt = np.random.default_rng(1).integers(0, 320, 20).tolist()
    batch = build_batch([Row(prompt, 0, [1, 2, 3, 4, 5])], 4, 320, 20, 1, 5)
    want = np.asarray(Steps(target.config, jnp.float32).forward_logits(
        target.params, init_kv_cache(target.config, 6, 4, jnp.float32), batch)[0])
    seqs = [{"tokens": prompt, "prompt_len": 1}, {"tokens": prompt[:7], "prompt_len": 1}]
    tokens, positions, _ = td.pad_batch(seqs, 24)
    model = td.DecoderModel(target.config, jnp.float32, "dense")
    got = np.asarray(td.batch_logits(model, target.params, tokens, positions))
    np.testing.assert_allclose(got[0, :20], want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got[1, :7], want[:7], atol=1e-4, rtol=1e-4)
    config, params, chosen = td.init_draft(target.config, target.params, 2)
    assert chosen == [0, 1]
    seqs = [{"tokens": prompt, "prompt_len": 5}]
    eval_step = td.make_eval_step(td.DecoderModel(config, jnp.float32, "dense"), model)
    full = td.evaluate(eval_step, params, target.params, seqs, 24, 1)
    assert full["agreement"] == 1.0 and abs(full["kl"]) < 1e-4


def test_accepted_runs():
    agree = np.array([1, 1, 0, 1, 1, 1, 1, 1, 0, 0], bool)
    # from 0: 2 accepted, the next starts at 3; from 3: 4 accepted (k), the next at 8; 8 + 4 > 10: stop
    assert td.accepted_runs(agree, 4) == [2, 4]
