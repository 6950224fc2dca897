"""Multi-LoRA's device side against HF transformers + PEFT float32: adapters loaded and refused
(`jaxserve.lora.adapter`), a ragged batch mixing two adapters of different ranks and targets with base rows (Llama,
Qwen3, Gemma 3 tiny models; int8 base weights; tensor parallelism), the LoRA term's ways of computing it, and slots
filled with no compilation."""
import argparse
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxserve
from jaxserve import EngineConfig, LoRARequest
from jaxserve.lora.adapter import LoRAError, load_adapter
from jaxserve.model.fused import FUSED
from jaxserve.model.lora import METHODS, lora_delta, one_slot
from jaxserve.parallel.mesh import MODEL
from jaxserve.runner.batch_builder import Row, build_batch

from hf_models import peft_model, save_tiny_lora, save_tiny_model
from tiny import make_llm

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two adapters unlike each other: rank 4 on three targets, and rank 8 with rsLoRA on every target of layer 1 only
# (layer 0 missing), with PEFT's per-module rank and alpha overrides.
ADAPTERS = {
    "a1": dict(seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "a2": dict(seed=2, r=8, lora_alpha=4, use_rslora=True, target_modules=ALL, layers_to_transform=[1],
               rank_pattern={"o_proj": 2}, alpha_pattern={"gate_proj": 3}),
}
SLOTS = {"a1": 0, "a2": 1}
ROWS = [("a1", 5), (None, 9), ("a2", 7), ("a1", 3)]  # (adapter, prompt length)


def save_adapters(base, tmp):
    return {name: str(save_tiny_lora(base, tmp / name, **kw)) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def family(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    save_tiny_model(request.param, tmp / "base")
    return str(tmp / "base"), save_adapters(str(tmp / "base"), tmp)


def lora_llm(base, adapters, **kw):
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    for name, path in adapters.items():
        llm.runner.load_lora(SLOTS[name], load_adapter(LoRARequest(name, SLOTS[name] + 1, path),
                                                       llm.config, 8))
    return llm


def ragged_logits(runner, rows, lora=True):
    """Per row, the float32 logits of its tokens, all rows in one step (rows: (token ids, slot))."""
    built, first = [], 1
    for ids, slot in rows:
        n = -(-len(ids) // runner.page_size)
        built.append(Row(ids, 0, list(range(first, first + n)), lora_slot=slot))
        first += n
    batch = build_batch(built, runner.page_size, runner.config.vocab_size, 32, 4, runner.buckets.pages_per_row)
    logits, runner.kv_cache = runner.steps.forward_logits(runner.params, runner.kv_cache, batch,
                                                          runner.lora if lora else None)
    bounds = np.cumsum([0] + [len(ids) for ids, _ in rows])
    return [np.asarray(logits)[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def reference_logits(base, adapter, ids):
    """HF transformers (+ PEFT with an adapter) float32 logits [T, V]."""
    with torch.no_grad():
        return _reference(base, adapter)(torch.tensor([ids])).logits[0].numpy()


@functools.cache
def _reference(base, adapter):
    return (peft_model(base, adapter) if adapter else
            transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())


def assert_close(got, want, what, tol=1e-5):
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < tol, what


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 320, n).tolist() for _, n in ROWS]


def test_a_ragged_batch_of_two_adapters_and_base_rows_matches_peft(family):
    base, adapters = family
    llm = lora_llm(base, adapters)
    ps = prompts()
    got = ragged_logits(llm.runner, [(p, SLOTS.get(name, -1)) for p, (name, _) in zip(ps, ROWS)])
    for p, (name, _), logits in zip(ps, ROWS, got):
        assert_close(logits, reference_logits(base, adapters.get(name), p), name)
    # A base row of a LoRA batch is the base model's row: the same as a step without adapters, to float32 rounding
    # (bit for bit on Llama and Qwen3; XLA:CPU fuses Gemma 3's LoRA program so that it differs by ~1e-6).
    alone = ragged_logits(llm.runner, [(ps[1], -1)], lora=False)[0]
    np.testing.assert_allclose(got[1], alone, rtol=0, atol=1e-5)
    llm.core.assert_idle_and_clean()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-llama-8-heads")
    save_tiny_model("llama-8-heads", tmp / "base")  # 2 KV heads: split at TP 2, repeated at TP 4
    return str(tmp / "base"), save_adapters(str(tmp / "base"), tmp)


@pytest.fixture(scope="module")
def one_device(llama):
    """The mixed batch's logits on one device."""
    rows = [(p, SLOTS.get(name, -1)) for p, (name, _) in zip(prompts(), ROWS)]
    return rows, ragged_logits(lora_llm(*llama).runner, rows)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_with_adapters_gives_one_devices_logits(llama, one_device, tp):
    base, adapters = llama
    rows, want = one_device
    llm = lora_llm(base, adapters, tensor_parallel_size=tp)
    for got, w in zip(ragged_logits(llm.runner, rows), want):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    # Split as their base layers: a column-parallel layer's B by outputs, a row-parallel layer's A by inputs (k's B
    # holds each KV head repeated, one per device, at TP 4).
    layer = llm.runner.lora["layers_0"]
    assert layer["q_proj"]["b"].sharding.spec == jax.sharding.PartitionSpec(None, None, MODEL)
    assert layer["k_proj"]["b"].shape[2] == max(2, tp) * llm.config.head_dim
    assert layer["k_proj"]["b"].sharding.spec == jax.sharding.PartitionSpec(None, None, MODEL)
    assert layer["o_proj"]["a"].sharding.spec == jax.sharding.PartitionSpec(None, MODEL, None)
    assert layer["down_proj"]["a"].sharding.spec == jax.sharding.PartitionSpec(None, MODEL, None)


def test_int8_base_weights_with_adapters_match_peft_over_the_dequantized_model(llama, tmp_path):
    """The LoRA term is added to the int8 matmul's output: the reference is PEFT over the int8 weights dequantized.
    On CPU the int8 dot also rounds the activations, to two int8 digits (about 15 bits: quant.int8_dot_matmul),
    which moves the logits by ~2e-4 of their range here; an adapter's term is far larger."""
    base, adapters = llama
    llm = lora_llm(base, adapters, quantization="int8")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            linears = dict([*layer.self_attn.named_children(), *layer.mlp.named_children()])
            # [in, out] int8 values * scale per output, by projection (the runner serves q/k/v and gate/up fused)
            kernels = {name: np.asarray(p["kernel"].values, np.float32) * np.asarray(p["kernel"].scale)
                       for name, p in llm.runner.params["params"][f"layers_{i}"].items() if "kernel" in p}
            for fused, names in FUSED.items():
                widths = np.cumsum([linears[n].out_features for n in names])[:-1]
                kernels.update(zip(names, np.split(kernels.pop(fused), widths, axis=1)))
            for name, linear in linears.items():
                if name in kernels:
                    linear.weight.copy_(torch.tensor(kernels[name]).T)
    model.save_pretrained(tmp_path / "dequantized")
    ps = prompts()
    got = ragged_logits(llm.runner, [(p, SLOTS.get(name, -1)) for p, (name, _) in zip(ps, ROWS)])
    for p, (name, _), logits in zip(ps, ROWS, got):
        want = reference_logits(str(tmp_path / "dequantized"), adapters.get(name), p)
        assert_close(logits, want, name, tol=1e-3)
        if name in adapters:  # the tolerance still tells an adapter's output from the base model's
            base_only = reference_logits(str(tmp_path / "dequantized"), None, p)
            assert np.max(np.abs(want - base_only)) / np.max(np.abs(want)) > 1e-2, name


def test_filling_and_emptying_slots_compiles_nothing(llama):
    base, adapters = llama
    llm = lora_llm(base, {"a1": adapters["a1"]})
    r = llm.runner
    rows = [(prompts()[0], 0), (prompts()[1], 1)]
    before = ragged_logits(r, rows)
    steps, slot_writes = r.steps._logits._cache_size(), r.lora_compiled()
    assert slot_writes == 1
    a2 = load_adapter(LoRARequest("a2", 2, adapters["a2"]), llm.config, 8)
    r.load_lora(1, a2)
    r.clear_lora(0)
    after = ragged_logits(r, rows)
    assert (r.steps._logits._cache_size(), r.lora_compiled()) == (steps, slot_writes)
    # Slot 0 emptied: the base model's logits; slot 1 filled: a2's.
    np.testing.assert_array_equal(after[0], ragged_logits(r, [(prompts()[0], -1)], lora=False)[0])
    assert not np.allclose(after[1], before[1])
    assert_close(after[1], reference_logits(base, adapters["a2"], prompts()[1]), "a2")


def test_the_runner_refuses_slots_it_does_not_have(llama):
    base, adapters = llama
    llm = lora_llm(base, adapters)
    r = llm.runner
    with pytest.raises(ValueError, match="LoRA slot 2"):
        r.dispatch([Row([1, 2], 0, [1], lora_slot=2)])
    with pytest.raises(ValueError, match="slot must be"):
        r.load_lora(2, load_adapter(LoRARequest("a1", 1, adapters["a1"]), llm.config, 8))
    with pytest.raises(ValueError, match="above max_lora_rank 4"):
        make_llm(base, enable_lora=True, max_lora_rank=4).runner.load_lora(
            0, load_adapter(LoRARequest("a2", 2, adapters["a2"]), llm.config, 8))
    plain = make_llm(base)
    assert plain.runner.lora is None
    with pytest.raises(ValueError, match="enable_lora off"):
        plain.runner.dispatch([Row([1, 2], 0, [1], lora_slot=0)])


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("num_tokens, num_slots", [(1, 1), (13, 3), (64, 8)])
def test_each_lora_delta_method_is_each_tokens_own_adapter(method, num_tokens, num_slots):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, 24), np.float32)
    a = rng.standard_normal((num_slots, 24, 4), np.float32)
    b = rng.standard_normal((num_slots, 4, 40), np.float32)
    slot = rng.integers(-1, num_slots, num_tokens).astype(np.int32)
    got = np.asarray(jax.jit(lora_delta, static_argnames="method")(x, a, b, slot, method=method))
    want = np.stack([x[t] @ a[s] @ b[s] if s >= 0 else np.zeros(40, np.float32) for t, s in enumerate(slot)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    assert (got[slot < 0] == 0).all(), f"seed {seed}: a base token's LoRA term is not exactly 0"


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_a_one_adapter_chunk_takes_the_indexed_term_and_equals_the_sorted_one(num_tokens):
    """A step whose adapter tokens all name one slot (one sequence's prefill chunk, base rows beside it or not) takes
    the segmented method's one-slot branch, which gives the sorted blocks' term to float32 rounding; a step of two
    slots does not."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, 24), np.float32)
    a = rng.standard_normal((8, 24, 4), np.float32)
    b = rng.standard_normal((8, 4, 40), np.float32)
    s = int(rng.integers(0, 8))
    slot = np.where(rng.random(num_tokens) < 0.7, s, -1).astype(np.int32)
    assert bool(one_slot(slot)), f"seed {seed}"
    got = np.asarray(jax.jit(lora_delta, static_argnames="method")(x, a, b, slot, method="segmented"))
    sorted_ = np.asarray(jax.jit(lora_delta, static_argnames="method")(x, a, b, slot, method="sorted"))
    np.testing.assert_allclose(got, sorted_, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    assert (got[slot < 0] == 0).all(), f"seed {seed}"
    assert bool(one_slot(np.full(num_tokens, -1, np.int32)))  # no adapter token: nothing to sort either
    if num_tokens > 1:
        assert not bool(one_slot(np.array([s, (s + 1) % 8] + [-1] * (num_tokens - 2), np.int32)))


# ---- adapters refused: each error names the adapter and the field ----

@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-bad")
    save_tiny_model("llama", tmp / "base")
    other = save_tiny_model("llama", tmp / "other", intermediate_size=96)  # noqa: F841 (another model's shapes)
    good = save_tiny_lora(str(tmp / "base"), tmp / "good", r=4, lora_alpha=8, target_modules=ALL)
    return tmp, str(tmp / "base"), good


def _config(tmp):
    from jaxserve.weights import load_model
    return load_model(str(tmp / "base"), jnp.float32).config


def _edit_config(path, **fields):
    c = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**c, **fields}))


def _edit_tensors(path, edit):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


BAD = {
    "use_dora": lambda p: _edit_config(p, use_dora=True),
    "modules_to_save": lambda p: _edit_config(p, modules_to_save=["lm_head"]),
    "bias": lambda p: _edit_config(p, bias="all"),
    "peft_type": lambda p: _edit_config(p, peft_type="IA3"),
    "lora_alpha": lambda p: _edit_config(p, lora_alpha="big"),
    "adapter_config.json": lambda p: (p / "adapter_config.json").write_text("{not json"),
    "adapter_model.safetensors": lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"),
    "layer 0 q_proj": lambda p: _edit_tensors(p, lambda t: t.pop(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")),
    "layers.7": lambda p: _edit_tensors(p, lambda t: t.update({
        k.replace("layers.1.", "layers.7."): v for k, v in list(t.items()) if "layers.1." in k})),
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_malformed_adapter_is_refused_naming_the_field(tiny_adapter, tmp_path, field):
    tmp, _, good = tiny_adapter
    path = tmp_path / "bad"
    shutil.copytree(good, path)
    BAD[field](path)
    with pytest.raises(LoRAError, match=f"'bad'.*{field}"):
        load_adapter(LoRARequest("bad", 1, str(path)), _config(tmp), 16)


def test_unsupported_targets_wrong_shapes_and_high_ranks_are_refused(tiny_adapter, tmp_path):
    tmp, base, good = tiny_adapter
    config = _config(tmp)
    with pytest.raises(LoRAError, match="'good'.*layer 0 q_proj: rank 4 is above max_lora_rank 2"):
        load_adapter(LoRARequest("good", 1, str(good)), config, 2)
    other = save_tiny_lora(str(tmp / "other"), tmp_path / "other", r=4, target_modules=["up_proj"])
    with pytest.raises(LoRAError, match="'other'.*layer 0 up_proj.*do not fit the base layer's"):
        load_adapter(LoRARequest("other", 1, str(other)), config, 16)
    for target in ("embed_tokens", "lm_head"):
        path = save_tiny_lora(base, tmp_path / target, r=4, target_modules=["q_proj", target])
        with pytest.raises(LoRAError, match=f"'{target}'.*{target}.*not a LoRA weight"):
            load_adapter(LoRARequest(target, 1, str(path)), config, 16)
    with pytest.raises(LoRAError, match="'missing'.*not found, not readable, or not a PEFT LoRA adapter"):
        load_adapter(LoRARequest("missing", 1, str(tmp_path / "nowhere")), config, 16)


def test_the_adapter_folds_its_scaling_into_b(tiny_adapter, tmp_path):
    _, base, _ = tiny_adapter
    path = save_tiny_lora(base, tmp_path / "rs", r=4, lora_alpha=6, use_rslora=True, target_modules=["v_proj"])
    adapter = load_adapter(LoRARequest("rs", 3, str(path)), _config(tiny_adapter[0]), 16)
    from safetensors.numpy import load_file
    raw = load_file(path / "adapter_model.safetensors")
    a, b = adapter.weights[1, "v_proj"]
    np.testing.assert_array_equal(a, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].T)
    np.testing.assert_allclose(b, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].T * 6 / 2,
                               rtol=1e-6)
    assert (adapter.name, adapter.id, adapter.rank, sorted(adapter.weights)) == ("rs", 3, 4,
                                                                                  [(0, "v_proj"), (1, "v_proj")])


def test_a_bfloat16_adapter_loads_as_its_float32_values(tiny_adapter, tmp_path):
    """Adapters are often saved in bf16 (numpy has no bf16 of its own: ml_dtypes')."""
    import ml_dtypes
    tmp, _, good = tiny_adapter
    path = tmp_path / "bf16"
    shutil.copytree(good, path)
    _edit_tensors(path, lambda t: t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}))
    config = _config(tmp)
    got = load_adapter(LoRARequest("bf16", 1, str(path)), config, 16)
    want = load_adapter(LoRARequest("good", 1, str(good)), config, 16)
    assert sorted(got.weights) == sorted(want.weights)
    for key, (a, b) in want.weights.items():
        np.testing.assert_allclose(got.weights[key][0], a, rtol=1e-2, atol=1e-3, err_msg=str(key))
        np.testing.assert_allclose(got.weights[key][1], b, rtol=1e-2, atol=1e-3, err_msg=str(key))


def test_lora_request_and_engine_options():
    assert jaxserve.LoRARequest is LoRARequest
    assert LoRARequest("x", 1, "/p") == LoRARequest("x", 1, "/p")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="max_loras, max_lora_rank need enable_lora"):
        EngineConfig(max_loras=4, max_lora_rank=8)
    with pytest.raises(ValueError, match="max_cpu_loras .2. must be at least max_loras .4."):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p, serving=True)
    c = EngineConfig.from_cli_args(p.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8",
                                                 "--max-cpu-loras", "6"]))
    assert (c.enable_lora, c.max_loras, c.max_lora_rank, c.max_cpu_loras) == (True, 4, 8, 6)
    assert (EngineConfig().enable_lora, EngineConfig().max_loras, EngineConfig().max_lora_rank,
            EngineConfig().max_cpu_loras) == (False, 1, 16, None)
