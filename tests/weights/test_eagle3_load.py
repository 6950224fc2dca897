"""EAGLE-3 heads in the public layouts (the EAGLE reference's and speculators'), loaded and written."""
import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eagle3_heads import (
    TINY_TARGET,
    checkpoint_config,
    checkpoint_tensors,
    random_head,
    write_checkpoint,
    write_tiny_head,
)
from safetensors.numpy import load_file

from jaxserve.batch import RaggedRows
from jaxserve.cache.kv_cache import init_kv_cache
from jaxserve.model.eagle3 import Eagle3Head
from jaxserve.model.head_config import default_feature_layers
from jaxserve.weights.eagle3 import load_head, save_head

LAYOUTS_AND_FILES = [("eagle3", "safetensors"), ("eagle3", "bin"), ("speculators", "safetensors")]


def assert_same_head(loaded, expected, note=""):
    assert loaded.config == expected.config, note
    flat, tree = jax.tree.flatten(loaded.params)
    want, want_tree = jax.tree.flatten(expected.params)
    assert tree == want_tree, note
    for path, got, ref in zip(jax.tree_util.tree_leaves_with_path(loaded.params), flat, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape, (note, path[0])
        np.testing.assert_array_equal(got, ref, err_msg=f"{note} {jax.tree_util.keystr(path[0])}")
    np.testing.assert_array_equal(loaded.d2t, expected.d2t, err_msg=note)
    assert loaded.d2t.dtype == np.int32


@pytest.mark.parametrize("layout, weights", LAYOUTS_AND_FILES)
def test_each_layout_loads_the_head_written(tmp_path, layout, weights):
    seed = 11
    path = write_tiny_head(tmp_path / "head", TINY_TARGET, layout, seed, weights, hidden_size=48,
                           norm_before_residual=True)
    assert_same_head(load_head(path, TINY_TARGET), random_head(TINY_TARGET, seed, hidden_size=48,
                                                               norm_before_residual=True), f"seed {seed}")


@pytest.mark.parametrize("attention_bias", [False, True])
def test_the_loaded_tree_is_the_heads_declared_tree(tmp_path, attention_bias):
    """Leaf for leaf, the shapes Eagle3Head.init makes: the runner uses the loaded tree as the head's params."""
    path = write_tiny_head(tmp_path, TINY_TARGET, "speculators", seed=2, attention_bias=attention_bias)
    head = load_head(path, TINY_TARGET)
    assert_same_head(head, random_head(TINY_TARGET, seed=2, attention_bias=attention_bias), "seed 2")
    c = head.config

    def init():
        one, T = jnp.zeros(1, jnp.int32), 1
        rows = RaggedRows(positions=one, token_row=one, query_start=jnp.zeros(2, jnp.int32), cached_lens=one,
                          page_table=jnp.zeros((1, 1), jnp.int32))
        return Eagle3Head(c).init(jax.random.key(0), one, jnp.zeros((T, c.feature_size)),
                                  jnp.zeros((T, c.hidden_size)), jnp.ones(T, bool),
                                  init_kv_cache(c.layer_config(), 2, 16, jnp.float32), rows)
    declared = jax.tree.map(lambda x: (x.shape, x.dtype), nn.meta.unbox(jax.eval_shape(init)))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), head.params) == declared


def test_dtype_and_defaults(tmp_path):
    """Absent fields read as vLLM reads them: the layers (2, L // 2, L - 3) of the target, the target's vocabulary
    as the draft's (d2t the identity), norm_before_residual False in the reference layout and True in
    speculators'; no embed_tokens in the tree when the checkpoint has none (the target's is used)."""
    target = dataclasses.replace(TINY_TARGET, num_layers=8)
    head = random_head(target, seed=5, draft_vocab_size=target.vocab_size, feature_layers=(2, 4, 5),
                       embed_tokens=False)
    for layout, norm_before_residual in [("eagle3", False), ("speculators", True)]:
        config, tensors = checkpoint_config(head, layout), checkpoint_tensors(head, layout)
        for field in ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
                      "eagle_aux_hidden_state_layer_ids", "eagle_config"):
            config.pop(field, None)
        tensors.pop("d2t", None), tensors.pop("t2d", None)
        loaded = load_head(write_checkpoint(tmp_path / layout, config, tensors), target, dtype=jnp.bfloat16)
        assert loaded.config.feature_layers == default_feature_layers(8) == (2, 4, 5)
        assert loaded.config.draft_vocab_size == target.vocab_size and not loaded.d2t.any()
        assert loaded.config.target_hidden_size == target.hidden_size
        assert loaded.config.norm_before_residual is norm_before_residual, layout
        assert "embed_tokens" not in loaded.params["params"]
        assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.bfloat16)}
        np.testing.assert_array_equal(loaded.params["params"]["fc"]["kernel"],
                                      head.params["params"]["fc"]["kernel"].astype(jnp.bfloat16))


def test_a_reference_head_named_only_llama_loads_by_its_tensors(tmp_path):
    """Some EAGLE-3 heads' config.json says only LlamaForCausalLM (e.g. nebius/EAGLE3-gpt-oss-20b)."""
    head = random_head(TINY_TARGET, seed=4)
    config = {**checkpoint_config(head, "eagle3"), "architectures": ["LlamaForCausalLM"]}
    path = write_checkpoint(tmp_path, config, checkpoint_tensors(head, "eagle3"))
    assert_same_head(load_head(path, TINY_TARGET), head, "seed 4")


def test_layers_listed_out_of_order_read_in_layer_order(tmp_path):
    """vLLM concatenates the target's states in layer order whatever order the config lists them in: so does fc."""
    head = random_head(TINY_TARGET, seed=6)
    config = {**checkpoint_config(head, "speculators"), "eagle_aux_hidden_state_layer_ids": [2, 0, 1]}
    path = write_checkpoint(tmp_path, config, checkpoint_tensors(head, "speculators"))
    assert_same_head(load_head(path, TINY_TARGET), head, "seed 6")


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_save_then_load_round_trips(tmp_path, layout, dtype):
    seed = 7
    head = random_head(TINY_TARGET, seed)
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)  # as Llama-3.1's heads have it
    head = dataclasses.replace(head, params=jax.tree.map(lambda x: np.asarray(x, dtype), head.params),
                               config=dataclasses.replace(head.config, rope_scaling=llama3, rope_theta=500000.0))
    save_head(tmp_path, head, layout, target_name="tiny", target_architectures=("LlamaForCausalLM",))
    assert_same_head(load_head(tmp_path, TINY_TARGET, dtype=dtype), head, f"seed {seed} {layout}")
    # What it wrote is the layout's, name for name, as the reference and speculators write it.
    assert set(load_file(tmp_path / "model.safetensors")) == set(checkpoint_tensors(head, layout))
    written, expected = json.loads((tmp_path / "config.json").read_text()), checkpoint_config(head, layout)
    nested = ("transformer_layer_config", "eagle_config", "speculators_config")
    for key in expected.keys() - {"speculators_version", "torch_dtype", *nested}:
        assert written[key] == expected[key], key
    for key in set(nested) & expected.keys():  # the fields the other readers take from each nested object
        assert {k: written[key][k] for k in expected[key] if k != "torch_dtype"} == \
            {k: v for k, v in expected[key].items() if k != "torch_dtype"}, key


def edit_config(path, change):
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    change(config)
    config_file.write_text(json.dumps(config))


def edit_tensors(path, change):
    tensors = load_file(Path(path) / "model.safetensors")
    change(tensors)
    write_checkpoint(path, json.loads((Path(path) / "config.json").read_text()), tensors)


def layer_of(config):
    return config.get("transformer_layer_config", config)


# (layout, what is wrong, the edit, what the error must name)
BAD_HEADS = [
    ("eagle3", "no hidden size", lambda p: edit_config(p, lambda c: c.pop("hidden_size")), "hidden_size"),
    ("speculators", "no intermediate size",
     lambda p: edit_config(p, lambda c: c["transformer_layer_config"].pop("intermediate_size")),
     "transformer_layer_config.intermediate_size"),
    ("eagle3", "a missing tensor", lambda p: edit_tensors(p, lambda t: t.pop("midlayer.mlp.up_proj.weight")),
     "midlayer.mlp.up_proj.weight"),
    ("speculators", "an extra tensor",
     lambda p: edit_tensors(p, lambda t: t.update({"layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)})),
     "layers.0.self_attn.q_norm.weight"),
    ("eagle3", "a shape off its config",
     lambda p: edit_config(p, lambda c: c.update(intermediate_size=64)), "midlayer.mlp.gate_proj.weight"),
    ("speculators", "a layer listed twice",
     lambda p: edit_config(p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 2])),
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", "fc's width for two layers",
     lambda p: edit_config(p, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2])),
     "fc.weight has shape [64, 192], the config gives [64, 128] (fc reads 2 target layers"),
    ("speculators", "another target's hidden size",
     lambda p: edit_config(p, lambda c: c.update(target_hidden_size=32)), "target_hidden_size"),
    ("eagle3", "another target's vocabulary", lambda p: edit_config(p, lambda c: c.update(vocab_size=321)),
     "vocab_size 321"),
    ("speculators", "a layer the target lacks",
     lambda p: edit_config(p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 3])),
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", "d2t outside the vocabulary", lambda p: edit_tensors(p, lambda t: t["d2t"].__setitem__(-1, 500)),
     "d2t maps draft ids [159]"),
    ("eagle3", "d2t onto one id twice", lambda p: edit_tensors(p, lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1)),
     "d2t maps two draft ids"),
    ("speculators", "no d2t for a reduced vocabulary", lambda p: edit_tensors(p, lambda t: t.pop("d2t")),
     "missing tensor d2t"),
    ("eagle3", "t2d against d2t", lambda p: edit_tensors(p, lambda t: t["t2d"].__setitem__(slice(None), False)),
     "t2d and d2t disagree"),
    ("speculators", "a plain Llama", lambda p: edit_config(p, lambda c: c.update(
        architectures=["LlamaForCausalLM"], speculators_model_type=None)), "no EAGLE-3 layout"),
    ("speculators", "another speculator", lambda p: edit_config(p, lambda c: c.update(speculators_model_type="mlp")),
     "speculators_model_type 'mlp'"),
    ("speculators", "a norm before fc", lambda p: edit_config(p, lambda c: c.update(norm_before_fc=True)),
     "norm_before_fc is True"),
    ("eagle3", "two layers", lambda p: edit_config(p, lambda c: c.update(num_hidden_layers=2)),
     "num_hidden_layers is 2"),
    ("speculators", "a Qwen3 layer",
     lambda p: edit_config(p, lambda c: c["transformer_layer_config"].update(model_type="qwen3")),
     "transformer_layer_config.model_type"),
    ("eagle3", "no weights", lambda p: (Path(p) / "model.safetensors").unlink(), "holds no weights"),
    ("eagle3", "no config", lambda p: (Path(p) / "config.json").unlink(), "has no config.json"),
]


@pytest.mark.parametrize("layout, why, edit, named", BAD_HEADS, ids=[b[1] for b in BAD_HEADS])
def test_a_head_that_does_not_fit_is_refused_naming_the_field(tmp_path, layout, why, edit, named):
    path = write_tiny_head(tmp_path / "head", TINY_TARGET, layout, seed=3)
    edit(path)
    with pytest.raises(ValueError) as error:
        load_head(path, TINY_TARGET)
    assert named in str(error.value) and path in str(error.value), (why, str(error.value))
