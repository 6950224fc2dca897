"""Tensor and data parallelism over a mesh of CPU devices (conftest forces 8): the tokens and float32 logits of one
device, with the weights and the KV pages really split, nothing resharded or recompiled while serving, and requests
spread over data-parallel replicas."""
import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.aot.collectives import collective_census
from jaxserve.parallel.mesh import MODEL, bytes_per_device
from jaxserve.runner.batch_builder import Row, build_batch
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.weights.params import param_bytes

from hf_models import save_tiny_model
from tiny import make_llm, prompts, step_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    """8 attention heads and 2 KV heads: KV heads split at TP 2, replicated at 4 and 8."""
    path = tmp_path_factory.mktemp("tiny-8-heads")
    save_tiny_model("llama-8-heads", path)
    return str(path)


def tokens(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tp_dir):
    ps = prompts(np.random.default_rng(0), [3, 9, 17, 30])
    return ps, tokens(make_llm(tp_dir), ps)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_gives_one_devices_tokens_and_logits(tp_dir, reference, tp):
    ps, want = reference
    llm = make_llm(tp_dir, tensor_parallel_size=tp)
    assert tokens(llm, ps) == want
    ids = ps[3]["prompt_token_ids"]
    np.testing.assert_allclose(step_logits(llm, ids), step_logits(make_llm(tp_dir), ids), rtol=1e-4, atol=1e-4)
    llm.core.assert_idle_and_clean()


@pytest.mark.parametrize("tp", [2, 8])
def test_weights_and_pages_are_split(tp_dir, tp):
    llm = make_llm(tp_dir, tensor_parallel_size=tp)
    r = llm.runner
    held = bytes_per_device(r.params)
    assert len(held) == tp
    # Everything but the norms (a few hundred floats) is split: each device holds about 1/tp of the weights.
    assert max(held.values()) < param_bytes(r.params) / tp * 1.05, held
    q = r.params["params"]["layers_0"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, MODEL)
    assert r.params["params"]["layers_0"]["o_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(MODEL, None)
    k_pages = r.kv_cache[0][0]  # [num_pages, kv_heads, page_size, head_dim]
    assert k_pages.shape[1] == max(2, tp)  # 2 KV heads, repeated to one per device beyond 2
    for shard in k_pages.addressable_shards:
        assert shard.data.shape == (k_pages.shape[0], 1 if tp >= 2 else 2, *k_pages.shape[2:])
    assert len(bytes_per_device(r.kv_cache)) == tp


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_split_consistently(tp_dir, quantization):
    one = make_llm(tp_dir, quantization=quantization)
    two = make_llm(tp_dir, quantization=quantization, tensor_parallel_size=2)
    ids = list(range(5, 25))
    np.testing.assert_allclose(step_logits(two, ids), step_logits(one, ids), rtol=1e-4, atol=1e-4)
    kernel = two.runner.params["params"]["layers_0"]["down_proj"]["kernel"]  # row-parallel: input rows split
    leaf = kernel.values if quantization == "int8" else kernel.packed
    assert leaf.sharding.spec[0] == MODEL


def test_a_step_gathers_no_weights_and_no_cache(tp_dir):
    """The decode step's communication is the all-reduce after each row-parallel layer (and the vocab-parallel
    embedding) and per-row values of the vocab-parallel sampler: no logits, weight or cache is ever gathered."""
    llm = make_llm(tp_dir, tensor_parallel_size=2)
    r = llm.runner
    batch = r.steps.put_batch(build_batch([Row([7], 0, [1])], r.page_size, r.config.vocab_size, 4, 4,
                                          r.buckets.pages_per_row))
    census = collective_census(r.steps._forward.lower(r.params, r.kv_cache, r.last_tokens, batch).compile().as_text())
    hidden, vocab = r.config.hidden_size, r.config.vocab_size
    # Each device's probability mass (the draw: jaxserve.sample.sampling.inverse_cdf), and its top K for top_logprobs,
    # of the sampled rows and of the prompt-logprob scorer's (jaxserve.sample.prompt_logprobs; each in a branch or loop
    # that runs only when a row asks): never logits.
    top_k = [(("f32", (4, 2 * MAX_LOGPROBS)),), (("s32", (4, 2 * MAX_LOGPROBS)),)]
    assert sorted(c.arrays for c in census if c.kind == "all-gather") == sorted([(("f32", (4, 2)),)] + 2 * top_k), \
        census
    assert not [c for c in census if any(vocab in dims or vocab // 2 in dims for _, dims in c.arrays)], census
    activations = [c for c in census if c.kind == "all-reduce" and ("f32", (4, hidden)) in c.arrays]
    assert len(activations) == 2 * r.config.num_layers + 1, census  # o_proj and down_proj per layer, the embedding


def test_serving_after_warmup_compiles_nothing_when_sharded(tp_dir):
    llm = make_llm(tp_dir, tensor_parallel_size=2, warmup=True)
    compiled = llm.runner.steps.num_compiled()
    rng = np.random.default_rng(1)
    llm.generate(prompts(rng, [2, 11, 40, 5, 23]), SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True),
                 use_tqdm=False)
    assert llm.runner.steps.num_compiled() == compiled


def test_tensor_parallel_sizes_that_cannot_split_are_refused(tp_dir):
    with pytest.raises(ValueError, match="must divide .* 8 attention heads"):
        make_llm(tp_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_llm(tp_dir, tensor_parallel_size=16)


def test_default_model_over_three_devices(default_llm):
    """The default model (9 heads, 3 KV heads, 576 hidden, 1536 FFN, 49152 vocabulary all divide by 3): the same
    greedy text as one device. One token a step, the prompt's included: one step shape to compile (each of this 30-layer
    model's programs costs more than its steps here); multi-token steps over a mesh are the tiny model's tests'."""
    from jaxserve import LLM
    sp = SamplingParams(temperature=0, max_tokens=32)
    chat = [{"role": "user", "content": "Name three primary colors."}]
    want = default_llm.chat(chat, sp, use_tqdm=False)[0].outputs[0].text
    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=1, max_num_batched_tokens=1, warmup=False,
              tensor_parallel_size=3)
    assert llm.chat(chat, sp, use_tqdm=False)[0].outputs[0].text == want
    assert len(bytes_per_device(llm.runner.kv_cache)) == 3


def test_data_parallel_replicas_share_the_work(tp_dir, reference):
    """Data parallel 2 x tensor parallel 2 on 4 devices: one device's tokens, requests spread over both replicas
    (each on its own two devices), every page freed."""
    ps, want = reference
    llm = make_llm(tp_dir, tensor_parallel_size=2, data_parallel_size=2)
    assert tokens(llm, ps) == want
    assert llm.core.routed == [2, 2]
    devices = [{d.id for d in bytes_per_device(r.runner.params)} for r in llm.replicas]
    assert devices == [{0, 1}, {2, 3}]
    assert all(r.stats().generation_tokens > 0 for r in llm.replicas)
    assert llm.stats().generation_tokens == sum(len(t) for t in want)
    llm.core.assert_idle_and_clean()


def test_data_parallel_routes_a_shared_prefix_to_the_replica_that_has_it(tp_dir):
    llm = make_llm(tp_dir, data_parallel_size=2)
    prefix = list(range(10, 30))
    llm.generate({"prompt_token_ids": prefix + [1]}, GREEDY, use_tqdm=False)  # replica 0 now caches the prefix
    assert llm.core.routed == [1, 0]
    llm.generate({"prompt_token_ids": prefix + [2]}, GREEDY, use_tqdm=False)  # both idle: the prefix decides
    assert llm.core.routed == [2, 0]
    assert llm.replicas[0].stats().prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_over_a_mesh_gives_the_plain_tokens(tp_dir, tiny_dir, reference, method):
    """Verification (and a draft model, on the same two devices, its own heads split) over TP 2."""
    ps, want = reference
    ps, want = ps + [{"prompt_token_ids": list(range(5, 13)) * 4}], want + tokens(  # one for n-grams to find
        make_llm(tp_dir), [{"prompt_token_ids": list(range(5, 13)) * 4}])
    spec = dict(method=method, num_speculative_tokens=3, adaptive=False, **({"model": tiny_dir} if method ==
                                                                             "draft_model" else {}))
    llm = make_llm(tp_dir, tensor_parallel_size=2, speculative_config=spec)
    assert tokens(llm, ps) == want
    assert llm.stats().spec_decode_num_drafts > 0
    if method == "draft_model":
        assert len(bytes_per_device(llm.replicas[0].proposer.runner.params)) == 2


def test_a_server_over_data_parallel_replicas(tp_dir, reference):
    from serving import ServerThread, wait_idle
    """Requests through the HTTP server land on both replicas and come back as one device computes them (compared
    by their logprobs: the tiny model has no tokenizer); /metrics counts both replicas' tokens."""
    import requests
    ps, _ = reference
    outs = make_llm(tp_dir).generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
                                     use_tqdm=False)
    st = ServerThread(make_llm(tp_dir, data_parallel_size=2), "tiny")
    try:
        for p, out in zip(ps, outs):
            want = [entry[t].logprob for t, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
            body = {"prompt": p["prompt_token_ids"], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}
            got = requests.post(st.url + "/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
        assert st.engine.llm.core.routed[1] > 0  # sequential requests: each finds both idle, the prefix decides
        wait_idle(st)  # a response can be sent before its replica's step is counted (CI saw 95 of the 96 tokens)
        text = requests.get(st.url + "/metrics", timeout=10).text
        assert 'jaxserve:generation_tokens_total{model_name="tiny"} 96' in text, text
    finally:
        st.stop()
