"""Decode context parallelism over 2 and 4 CPU devices (conftest forces 8): the KV cache split over the
tensor-parallel group by token, each device attending to its own tokens, the partials merged by log-sum-exp: one
device's tokens and logits, 1/d of the cache per device, and the combinations it cannot run refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import EngineConfig, SamplingParams
from jaxserve.parallel.context_parallel import local_slots, merge_partials
from jaxserve.parallel.mesh import MODEL, bytes_per_device, make_mesh

from hf_models import save_tiny_model
from tiny import make_llm, prompts, step_logits

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# Prompts of many pages (4-token pages; 8 or 16 tokens a page to the host at DCP 2 and 4) and chunked (16-token
# steps), decodes crossing page boundaries.
LENGTHS = [3, 9, 37, 50]


def tokens(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    ps = prompts(np.random.default_rng(3), LENGTHS)
    return ps, tokens(make_llm(tiny_dir), ps)


@pytest.mark.parametrize("d", [2, 4])
def test_dcp_gives_one_devices_tokens_and_logits(tiny_dir, reference, d):
    ps, want = reference
    llm = make_llm(tiny_dir, tensor_parallel_size=d, decode_context_parallel_size=d)
    assert llm.runner.page_size == 4 * d
    got = tokens(llm, ps)
    assert got == want, f"seed 3, d {d}"
    llm.core.assert_idle_and_clean()
    one = make_llm(tiny_dir)
    ids = ps[3]["prompt_token_ids"]  # 50 tokens: 13 pages of 4, cut into a cached part and a step
    np.testing.assert_allclose(step_logits(llm, ids[:30]), step_logits(one, ids[:30]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(step_logits(llm, ids, cached=30), step_logits(one, ids, cached=30), rtol=1e-4,
                               atol=1e-4)


def test_an_int8_cache(tiny_dir):
    """int8 pages with their per-token scales split alike: the tokens of one device's int8 cache."""
    ps = prompts(np.random.default_rng(7), [21, 40])
    want = tokens(make_llm(tiny_dir, kv_cache_dtype="int8"), ps)
    llm = make_llm(tiny_dir, kv_cache_dtype="int8", tensor_parallel_size=2, decode_context_parallel_size=2)
    assert tokens(llm, ps) == want, "seed 7"
    assert llm.runner.kv_cache[0][0].scale.addressable_shards[0].data.shape[2] == 4


def test_sliding_windows_by_position(tmp_path_factory):
    """Gemma 3's sliding layers (a 12-token window, shorter than the prompts) and its one KV head: a cached key's
    window is decided by its position (j * d + rank), the step's own keys by theirs."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_model("gemma3", path)
    ps = prompts(np.random.default_rng(6), [30, 45])
    one, llm = make_llm(str(path)), make_llm(str(path), tensor_parallel_size=2, decode_context_parallel_size=2)
    assert tokens(llm, ps) == tokens(one, ps), "seed 6"
    ids = ps[1]["prompt_token_ids"]  # 15 tokens after 30 cached: windows that cut the cache
    for cached, end in ((0, 30), (30, 45)):
        np.testing.assert_allclose(step_logits(llm, ids[:end], cached), step_logits(one, ids[:end], cached),
                                   rtol=1e-4, atol=1e-4, err_msg="seed 6")


@pytest.mark.parametrize("d", [2, 4])
def test_each_device_holds_1_over_d_of_the_cache(tiny_dir, d):
    """Every KV head (2, not repeated to one a device), 1/d of each page's tokens: the cache's bytes split evenly,
    where plain tensor parallelism at 4 holds each of the 2 KV heads twice."""
    llm = make_llm(tiny_dir, tensor_parallel_size=d, decode_context_parallel_size=d)
    k_pages = llm.runner.kv_cache[0][0]  # [num_pages, kv_heads, d * 4, head_dim]
    assert k_pages.shape[1:3] == (2, 4 * d)
    for shard in k_pages.addressable_shards:
        assert shard.data.shape == (k_pages.shape[0], 2, 4, k_pages.shape[3])
    held = bytes_per_device(llm.runner.kv_cache)
    total = sum(x.nbytes for x in jax.tree.leaves(llm.runner.kv_cache))
    assert len(held) == d and set(held.values()) == {total // d}
    if d == 4:
        tp = make_llm(tiny_dir, tensor_parallel_size=4).runner.kv_cache[0][0]
        assert tp.shape[1] == 4  # the 2 KV heads repeated: per page, twice DCP's bytes over the group


def test_decode_crosses_pages_and_continues_a_prefix(tiny_dir):
    """A shared prefix read back from the prefix cache (whole host pages) and a long decode: the tokens of one
    device, with speculation's verification steps too."""
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, 320, 40).tolist()
    ps = [{"prompt_token_ids": prefix + rng.integers(0, 320, n).tolist()} for n in (1, 6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dir).generate(ps, params, use_tqdm=False)]
    llm = make_llm(tiny_dir, tensor_parallel_size=2, decode_context_parallel_size=2,
                   speculative_config=dict(method="ngram", num_speculative_tokens=2, adaptive=False))
    for p, w in zip(ps, want):  # one after the other: the second finds the first's prefix
        assert llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids == w, "seed 4"
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("d", [2, 4])
def test_merge_by_log_sum_exp_is_exact(d):
    """Softmax attention over keys dealt to d ranks, merged from each rank's partial output and log-sum-exp, is the
    attention over all keys, for each rank's own heads; a rank that sees no key (lse -1e30) weighs nothing."""
    rng = np.random.default_rng(5)
    T, H, D, N = 3, 4, 8, 10
    s = rng.normal(size=(T, H, N)).astype(np.float32)
    v = rng.normal(size=(N, D)).astype(np.float32)
    full = np.einsum("thn,nd->thd", np.exp(s) / np.exp(s).sum(-1, keepdims=True), v)
    owner = np.arange(N) % d
    owner[owner == d - 1] = 0  # the last rank gets none
    outs, lses = [], []
    for r in range(d):
        mine = owner == r
        if not mine.any():
            outs.append(np.zeros((T, H, D), np.float32))
            lses.append(np.full((T, H), -1e30, np.float32))
            continue
        e = np.exp(s[..., mine])
        outs.append(np.einsum("thn,nd->thd", e / e.sum(-1, keepdims=True), v[mine]))
        lses.append(np.log(e.sum(-1)))
    mesh = make_mesh(d, 1)
    merged = jax.shard_map(lambda o, lse: merge_partials(o[0], lse[0], MODEL), mesh=mesh,
                           in_specs=(P(MODEL), P(MODEL)), out_specs=P(None, MODEL), check_vma=False)(
        jnp.asarray(np.stack(outs)), jnp.asarray(np.stack(lses)))
    np.testing.assert_allclose(np.asarray(merged), full, rtol=1e-5, atol=1e-5, err_msg="seed 5")


def test_tokens_go_to_rank_position_mod_d():
    """Host slots of 8-token pages at d 2: offset o of page p on rank o % 2 at local slot p * 4 + o // 2; the other
    rank's tokens to its scratch page."""
    slots = jnp.array([8 * 3 + 0, 8 * 3 + 5, 8 * 1 + 7, 2])
    assert local_slots(slots, 8, 2, 0).tolist() == [12, 0, 0, 1]
    assert local_slots(slots, 8, 2, 1).tolist() == [0, 14, 7, 0]


def test_combinations_it_cannot_run_are_refused(tiny_dir):
    with pytest.raises(ValueError, match=r"must be 1 or tensor_parallel_size \(4\), got 2"):
        EngineConfig(tensor_parallel_size=4, decode_context_parallel_size=2)  # before any model loads
    with pytest.raises(ValueError, match="decode_context_parallel_size must be an integer"):
        EngineConfig(decode_context_parallel_size=0)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        make_llm(tiny_dir, tensor_parallel_size=3, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="runs attention_backend 'reference'.* not 'dense'"):
        make_llm(tiny_dir, tensor_parallel_size=2, decode_context_parallel_size=2, attention_backend="dense")


def test_the_cli_flag_is_vllms():
    import argparse
    for flag in ("--decode-context-parallel-size", "-dcp"):
        p = argparse.ArgumentParser()
        EngineConfig.add_cli_args(p)
        args = p.parse_args(["--tensor-parallel-size", "2", flag, "2"])
        assert EngineConfig.from_cli_args(args).decode_context_parallel_size == 2
