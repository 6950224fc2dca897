"""The host KV tier in the engine: an evicted prefix comes back from host memory with the same tokens, a preempted
sequence is loaded back rather than recomputed, no page leaks, nothing compiles after warm-up, and /metrics says so."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.openai.metrics import ServerMetrics

from fake_runner import add_request, fake_llm
from serving import metric_samples
from tiny import TINY_PAGE_BYTES, make_llm

VOCAB = 320
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(llm, prompts, sp=GREEDY):
    return [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_an_evicted_prefix_is_loaded_from_the_host_with_the_same_tokens(tiny_dir):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, 40).tolist()  # 10 pages of 4 tokens
    others = [rng.integers(0, VOCAB, 44).tolist() for _ in range(3)]  # enough to evict it from 16 pages
    a, b = prefix + rng.integers(0, VOCAB, 3).tolist(), prefix + rng.integers(0, VOCAB, 5).tolist()
    small = dict(kv_cache_memory_bytes=17 * TINY_PAGE_BYTES, max_model_len=60)
    want = run(make_llm(tiny_dir, enable_prefix_caching=False, **small), [a] + others + [b])
    for size, hits in ((None, 0), (0.001, len(prefix))):  # without the tier the prefix was forgotten
        llm = make_llm(tiny_dir, kv_offloading_size=size, **small)
        got = run(llm, [a] + others)
        before = llm.stats()
        got += run(llm, [b])
        after = llm.stats()
        assert got == want, f"seed {seed}"
        assert after.prefix_cache_hits - before.prefix_cache_hits == hits, f"seed {seed}"
        assert after.kv_offload_hits - before.kv_offload_hits == hits
        assert after.prompt_tokens - before.prompt_tokens == len(b) - hits  # the loaded prefix is not prefilled
        llm.core.assert_idle_and_clean()
    assert after.kv_offload_loaded_pages == 10 and after.kv_offload_loaded_bytes == 10 * TINY_PAGE_BYTES
    assert after.kv_offload_stored_pages >= 10 and 0 < after.kv_offload_used_bytes <= 0.001 * 2**30


def test_preempted_sequences_come_back_from_the_host(tiny_dir):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(6, 14, 4)]
    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    want = run(make_llm(tiny_dir, max_num_seqs=1, enable_prefix_caching=False), prompts, sp)
    stats = {}
    for size in (None, 0.001):
        # 16 pages for 4 sequences of up to 50 tokens (13 pages each): they preempt each other.
        llm = make_llm(tiny_dir, kv_cache_memory_bytes=17 * TINY_PAGE_BYTES, max_model_len=52, async_scheduling=True,
                       kv_offloading_size=size)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, f"seed {seed}"
        stats[size] = llm.stats()
        llm.core.assert_idle_and_clean()
    on, off = stats[0.001], stats[None]
    assert on.num_preemptions > 0 and off.num_preemptions > 0, f"seed {seed}"
    assert on.kv_offload_loaded_pages > 0, f"seed {seed}"
    # Each recomputed only what it had not cached: with the tier, less of it.
    assert on.prompt_tokens - on.kv_offload_hits <= off.prompt_tokens, f"seed {seed}"


def test_serving_with_the_tier_compiles_nothing_after_warm_up(tiny_dir):
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 40).tolist()
    prompts = [prefix + [1]] + [rng.integers(0, VOCAB, 44).tolist() for _ in range(3)] + [prefix + [2, 3]]
    llm = make_llm(tiny_dir, kv_cache_memory_bytes=17 * TINY_PAGE_BYTES, max_model_len=60, kv_offloading_size=0.001,
                   warmup=True)
    runner = llm.runner
    compiled = runner.steps.num_compiled() + runner.transfer_compiled()
    run(llm, prompts)
    assert llm.stats().kv_offload_loaded_pages == 10
    assert runner.steps.num_compiled() + runner.transfer_compiled() == compiled
    tier = llm.replicas[0].host.tier
    assert tier.bytes_per_s and tier.tokens_per_s  # measured at warm-up: loading is weighed against recomputing


def test_recomputing_is_chosen_where_it_is_cheaper_than_loading():
    llm = fake_llm(num_pages=9, max_model_len=32, vocab_size=VOCAB, host_tier_bytes=1 << 20)
    tier = llm.replicas[0].host.tier
    prompts = [[i] * 12 for i in range(1, 4)]  # 3 pages each: the first is evicted by the others
    run(llm, prompts)
    assert tier.stored_pages > 0
    tier.bytes_per_s, tier.tokens_per_s = 1.0, 1e9  # loading a page: seconds; computing it: nothing
    run(llm, prompts[:1])
    assert tier.loaded_pages == 0 and llm.stats().kv_offload_hits == 0
    tier.bytes_per_s = 1e12
    run(llm, prompts[1:2])
    assert tier.loaded_pages > 0 and llm.stats().kv_offload_hits > 0
    llm.core.assert_idle_and_clean()


def test_metrics_show_the_host_tier():
    llm = fake_llm(num_pages=9, max_model_len=32, vocab_size=VOCAB, host_tier_bytes=1 << 20)
    prompts = [[i] * 12 for i in range(1, 4)]
    run(llm, prompts + prompts[:1])
    metrics = ServerMetrics()
    metrics.add_model("m", llm.stats)
    samples = metric_samples(metrics.exposition().decode())
    label = frozenset({'model_name="m"'})
    s = llm.stats()
    assert samples["jaxserve:kv_offload_hits_total", label] == s.kv_offload_hits > 0
    assert samples["jaxserve:kv_offload_store_bytes_sum", label] == s.kv_offload_stored_bytes > 0
    assert samples["jaxserve:kv_offload_store_bytes_count", label] == s.kv_offload_stored_pages
    assert samples["jaxserve:kv_offload_load_seconds_count", label] == s.kv_offload_loaded_pages > 0
    assert samples["jaxserve:kv_offload_usage_bytes", label] == s.kv_offload_used_bytes > 0
    llm.reset_prefix_cache()  # forgets the host's pages too
    assert llm.stats().kv_offload_used_bytes == 0 and len(llm.replicas[0].host.tier) == 0


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_no_page_leaks_and_loaded_pages_hold_their_tokens(data):
    """Aborts, preemptions and finishes at any point, with stores and loads in flight: every page is accounted
    for, and every sequence's cache holds its own tokens (the fake KV is the token written at each slot)."""
    llm = fake_llm(max_num_seqs=3, max_num_batched_tokens=8, num_pages=13, max_model_len=40, vocab_size=VOCAB,
                   host_tier_bytes=data.draw(st.integers(1, 12)) * 64)  # 1-12 fake pages of 64 bytes
    core, sched = llm.core, llm.scheduler
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shared = rng.integers(0, 4, 12).tolist()
    ids = []
    for _ in range(data.draw(st.integers(1, 6))):
        n = int(rng.integers(2, 24))
        prompt = (shared + rng.integers(0, VOCAB, n).tolist())[:n]
        sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 14)), ignore_eos=True)
        ids.append(add_request(llm, prompt, sp))
    for _ in range(400):
        if not core.has_unfinished():
            break
        if data.draw(st.integers(0, 9)) == 0:
            core.abort(ids[data.draw(st.integers(0, len(ids) - 1))])
        core.step()
        held: set[int] = set()
        for s in sched.running:
            held.update(s.pages)
            written = core.runner.kv[s.pages].reshape(-1)[:s.num_written]
            assert written.tolist() == s.token_ids[:s.num_written], f"request {s.request_id}"
        assert len(held) + sched.cache.num_available == sched.cache.allocator.num_usable
    core.assert_idle_and_clean()
