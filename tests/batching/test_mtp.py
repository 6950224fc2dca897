"""MTP heads in the engine: the target checkpoint's own multi-token-prediction layer proposes, the target verifies.

A tiny random MTP model (the tiny Llama plus a random MTP layer under DeepSeek-V3's names, tests/mtp_models.py),
served through the same head steps, runner and proposer as EAGLE-3: the text is plain decoding's, and each
proposal is the head's own, the chain a dense forward of the MTP module over the whole sequence gives.
"""
import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.cache import init_kv_cache
from jaxserve.model.decoder import DecoderModel
from jaxserve.model.heads import head_module, shared_params
from jaxserve.spec_config import SpeculativeConfig, add_speculative_cli_args, speculative_config_from_args
from jaxserve.weights import load_model
from jaxserve.weights.mtp import load_mtp_head, mtp_head_config

from head_chains import dense_rows, recorded_proposals
from mtp_models import LAYERS, write_mtp_model
from tiny import make_llm, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mtp(k=3, **kw):
    return dict(method="mtp", num_speculative_tokens=k, adaptive=False, **kw)


@pytest.fixture(scope="module", params=["shared", "copies"])
def mtp_dir(request, tiny_dir, tmp_path_factory):
    """shared: the head takes the target's embedding and LM head; copies: its checkpoint has its own."""
    return write_mtp_model(tiny_dir, tmp_path_factory.mktemp(f"mtp-{request.param}"), seed=5,
                           copies=request.param == "copies")


def tokens(llm, ps, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]


def reference_chain(model_dir, seq_tokens, k):
    """The MTP head's greedy proposals after seq_tokens by dense forwards over whole sequences: head position i
    reads token i + 1 and the target's final state at i (positions 0 .. N-2), a chained position the head's own
    output at the position before; the target's embedding, final norm and LM head unless the head has its own."""
    target = load_model(model_dir, "float32")
    head = load_mtp_head(model_dir, target.config, np.float32)
    hc, n = head.config, len(seq_tokens) - 1
    ids = jnp.asarray(seq_tokens[:n], jnp.int32)
    *_, features = DecoderModel(target.config, attention_backend="dense").apply(
        target.params, ids, init_kv_cache(target.config, 2, 4, jnp.float32), dense_rows(n), return_hidden=True,
        capture=hc.feature_layers)
    shared = {name: target.params["params"][name] for name in shared_params(hc)}
    params = {"params": {**shared, **head.params["params"]}}
    model, cache = head_module(hc, attention_backend="dense"), init_kv_cache(hc.layer_config(), 2, 4, jnp.float32)
    toks, hidden, proposals = list(seq_tokens[1:]), np.zeros((n, hc.hidden_size), np.float32), []
    feats = np.asarray(features)
    for j in range(k):
        f = np.concatenate([feats, np.zeros((j, feats.shape[1]), np.float32)])
        logits, out, _ = model.apply(params, jnp.asarray(toks, jnp.int32), jnp.asarray(f), jnp.asarray(hidden),
                                     jnp.asarray(np.arange(n + j) < n), cache, dense_rows(n + j))
        proposals.append(int(jnp.argmax(logits[-1])))
        toks.append(proposals[-1])
        hidden = np.concatenate([hidden, np.asarray(out[-1:])])
    return proposals


def test_greedy_text_is_plain_decodings(tiny_dir, mtp_dir):
    seed = int(np.random.default_rng().integers(2**31))
    ps = prompts(np.random.default_rng(seed), [2, 9, 17, 30])
    plain = tokens(make_llm(tiny_dir), ps)
    llm = make_llm(mtp_dir, speculative_config=mtp())
    assert llm.runner.steps.capture == (LAYERS,)  # the final state, before the final norm
    assert tokens(llm, ps) == plain, f"seed {seed}"
    assert llm.stats().spec_decode_num_draft_tokens > 0
    llm.core.assert_idle_and_clean()


def test_proposals_are_the_heads_chain(mtp_dir):
    seed = int(np.random.default_rng().integers(2**31))
    ps = prompts(np.random.default_rng(seed), [3, 21, 40])
    llm = make_llm(mtp_dir, speculative_config=mtp(k=3))
    seen = recorded_proposals(llm, ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) > 10
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(seen), 5, replace=False):
        seq, proposed = seen[i]
        assert proposed == reference_chain(mtp_dir, seq, len(proposed)), f"seed {seed}, {len(seq)} tokens"


def test_a_checkpoint_without_an_mtp_layer_is_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"has no MTP layer: no tensors under 'model.layers.2.'"):
        make_llm(tiny_dir, speculative_config=mtp())


def test_mtp_takes_no_model_and_eagle3_still_needs_one():
    assert SpeculativeConfig(method="mtp", num_speculative_tokens=2).model is None
    p = argparse.ArgumentParser()
    add_speculative_cli_args(p)
    value = speculative_config_from_args(p.parse_args(["--speculative-method", "mtp", "--num-speculative-tokens", "2"]))
    assert SpeculativeConfig.from_value(value) == SpeculativeConfig("mtp", 2)
    with pytest.raises(ValueError, match="needs its head's checkpoint directory"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=2)


def test_a_layer_the_head_does_not_compute_is_refused(tiny_dir, tmp_path):
    target = load_model(tiny_dir, "float32").config
    moe = write_mtp_model(tiny_dir, tmp_path / "moe", extra={
        f"model.layers.{LAYERS}.mlp.experts.0.gate_proj.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(ValueError, match=r"does not use: \['mlp.experts.0.gate_proj.weight'\]"):
        load_mtp_head(moe, target)
    with pytest.raises(ValueError, match="qk_norm is True"):
        mtp_head_config(dataclasses.replace(target, qk_norm=True))
    loaded = load_mtp_head(write_mtp_model(tiny_dir, tmp_path / "ok"), target)
    assert loaded.config.kind == "mtp" and loaded.config.feature_layers == (LAYERS,)
    assert loaded.params["params"]["eh_proj"]["kernel"].shape == (128, 64)  # [2H, H]: [embedding, hidden] in
    assert not loaded.d2t.any() and loaded.config.draft_vocab_size == target.vocab_size
