"""Continuous batching on the tiny model: batch invariance under chunking, prefix caching and preemption; page
accounting under aborts; priorities; the SLO batch cap; and the overlap of host and device work."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.batching.slo import SloController

from fake_runner import add_request, fake_llm
from tiny import TINY_PAGE_BYTES, make_llm, prompts

VOCAB = 320


def workload(rng, n=10):
    """Greedy and seeded-sampling requests of random lengths, half of them sharing a prefix of several pages."""
    prefix = rng.integers(0, VOCAB, 14).tolist()
    reqs = []
    for i in range(n):
        tail = rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
        ids = prefix + tail if i % 2 else rng.integers(0, VOCAB, int(rng.integers(1, 36))).tolist()
        max_tokens = int(rng.integers(1, 25))
        if i % 3 == 2:  # seeded sampling is batch-independent too
            sp = SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 30)), max_tokens=max_tokens,
                                ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        reqs.append(({"prompt_token_ids": ids}, sp))
    return reqs


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def one_at_a_time(tiny_dir):
    reqs = workload(np.random.default_rng())
    llm = make_llm(tiny_dir, max_num_seqs=1, enable_prefix_caching=False, max_num_batched_tokens=128)
    return reqs, [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in reqs]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk,pool", [(4, None), (12, None), (128, None), (12, 16)],
                         ids=["chunk=1page", "chunk=3pages", "unchunked", "preempting"])
def test_all_at_once_equals_one_at_a_time(tiny_dir, one_at_a_time, prefix_caching, chunk, pool):
    reqs, want = one_at_a_time
    kv_bytes = pool * TINY_PAGE_BYTES if pool else None  # 15 usable pages of 4 tokens: 60 tokens among 4 sequences
    # Async scheduling gives a sequence a row (and perhaps a page) in the step after its last: with it this pool
    # preempts with or without prefix caching (without it, only with).
    small_pool = {"max_model_len": 60, "async_scheduling": True} if pool else {}
    llm = make_llm(tiny_dir, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching,
                   kv_cache_memory_bytes=kv_bytes, **small_pool)
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert token_ids(outs) == want
    stats = llm.stats()
    if pool:
        assert stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    assert all(o.metrics.arrival_time <= o.metrics.first_scheduled_time <= o.metrics.first_token_time
               <= o.metrics.finished_time for o in outs)
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    llm.core.assert_idle_and_clean()


def test_shared_prefix_is_computed_once(tiny_dir):
    rng = np.random.default_rng()
    prefix = rng.integers(0, VOCAB, 40).tolist()  # 10 pages of 4 tokens
    a, b = prefix + rng.integers(0, VOCAB, 5).tolist(), prefix + rng.integers(0, VOCAB, 7).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = make_llm(tiny_dir)
    llm.generate({"prompt_token_ids": a}, sp, use_tqdm=False)
    before = llm.stats()
    out = llm.generate({"prompt_token_ids": b}, sp, use_tqdm=False)
    after = llm.stats()
    assert after.prompt_tokens - before.prompt_tokens == len(b) - len(prefix)  # only the suffix was prefilled
    assert after.prefix_cache_hits - before.prefix_cache_hits == len(prefix)
    fresh = make_llm(tiny_dir, enable_prefix_caching=False)
    assert token_ids(out) == token_ids(fresh.generate({"prompt_token_ids": b}, sp, use_tqdm=False))
    # A prompt that is entirely cached still computes its last token (its logits give the first output).
    before = llm.stats()
    llm.generate({"prompt_token_ids": prefix}, sp, use_tqdm=False)
    assert llm.stats().prompt_tokens - before.prompt_tokens == 4  # the last page, recomputed
    llm.core.assert_idle_and_clean()


@pytest.fixture(scope="module", params=["plain", "ngram", "draft"])
def small_pool_llm(request):
    """Plain, and speculating for every sequence every step (rollbacks, and a draft's proposals), over 16 usable
    pages: preemptions are common."""
    spec = {"plain": {}, "ngram": dict(ngram=3), "draft": dict(ngram=3, draft=True)}[request.param]
    return fake_llm(max_num_seqs=3, max_num_batched_tokens=8, num_pages=17, max_model_len=64, vocab_size=VOCAB,
                    **spec)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_pages_are_accounted_for_after_aborts_and_preemptions(small_pool_llm, data):
    llm, core, sched = small_pool_llm, small_pool_llm.core, small_pool_llm.scheduler
    # Each example starts from an idle engine and an empty prefix cache: hypothesis replays an example and needs it
    # to draw the same (the step count, and so the draws, depend on what earlier examples left behind). An example
    # hypothesis cuts short (a draw past the choices it allows raises StopTest, a BaseException) leaves its
    # sequences, and a step in flight, in this module's engine: they end first.
    for s in sched.waiting + sched.running:
        core.abort(s.request_id)
    while core.has_unfinished():
        core.step()
    core.assert_idle_and_clean()
    llm.reset_prefix_cache()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shared = rng.integers(0, 4, 12).tolist()  # few distinct tokens: prefixes collide often
    ids = []
    for i in range(data.draw(st.integers(1, 7))):
        n = int(rng.integers(1, 30))
        prompt = (shared + rng.integers(0, VOCAB, n).tolist())[:max(n, 2)] if i % 2 else \
            rng.integers(0, VOCAB, n).tolist()
        sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True)
        ids.append(add_request(llm, prompt, sp))
    for _ in range(400):
        if not core.has_unfinished():
            break
        if data.draw(st.integers(0, 9)) == 0:  # abort anything, at any point: waiting, mid-prefill, decoding
            core.abort(ids[data.draw(st.integers(0, len(ids) - 1))])
        core.step()
        holders: dict[int, int] = {}
        for s in sched.running:
            assert s.num_cached <= len(s.pages) * sched.page_size
            for p in s.pages:
                holders[p] = holders.get(p, 0) + 1
        for p in range(1, sched.cache.allocator.num_pages):
            assert sched.cache.refcount(p) == holders.get(p, 0), f"page {p}"
        held = len(holders)
        assert held + sched.cache.num_available == sched.cache.allocator.num_usable
    core.assert_idle_and_clean()


def test_interactive_requests_run_before_batch_ones():
    ps = prompts(np.random.default_rng(), [6, 6, 6, 6])
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for policy, interactive_first in [("priority", True), ("fcfs", False)]:
        llm = fake_llm(max_num_seqs=1, scheduling_policy=policy, vocab_size=VOCAB)
        request_ids = []
        for p, priority in zip(ps, [1, 1, 1, 0]):  # the interactive request arrives last
            request = llm._request(p, sp, priority)
            llm.core.add(request.seqs[0])
            request_ids.append((request.request_id, request.seqs[0]))
        order = []
        while llm.core.has_unfinished():
            order += [d.seq.request_id for d in llm.core.step() if d.finished]
        assert (order[0] == request_ids[-1][0]) == interactive_first, (policy, order)


def test_a_batch_request_is_not_starved_by_interactive_ones():
    rng = np.random.default_rng()
    llm = fake_llm(max_num_seqs=2, scheduling_policy="priority", vocab_size=VOCAB, max_model_len=96)
    core = llm.core
    (batch,) = llm._request({"prompt_token_ids": rng.integers(0, VOCAB, 10).tolist()},
                            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), priority=1).seqs
    core.add(batch)
    interactive = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for step in range(3000):
        while len(core.scheduler.waiting) < 3:  # a steady stream of better-priority requests
            core.add(llm._request(prompts(rng, [5])[0], interactive, priority=0).seqs[0])
        core.step()
        if batch.finished:
            break
    assert batch.finished and len(batch.output_token_ids) == 40


def test_slo_controller_sizes_the_batch_from_step_times():
    slo = SloController((1, 2, 4, 8, 16), 16, tpot_slo=0.05, ttft_slo=1.0)
    assert slo.batch_cap([], now=0) == 1  # nothing measured: start small
    slo.observe(1, 0.01)
    assert slo.batch_cap([], now=0) == 2  # then try the next size
    for b, t in [(2, 0.02), (4, 0.03), (8, 0.08)]:
        slo.observe(b, t)
    assert slo.batch_cap([], now=0) == 4  # 8 breaks the TPOT target
    for _ in range(slo.stale_after + 1):  # a long run at 4: the old verdict on 8 goes stale and 8 is tried again
        slo.observe(4, 0.03)
    assert slo.batch_cap([], now=0) == 8
    slo.observe(8, 0.2)
    assert slo.batch_cap([], now=0) == 4
    class Waiting:
        arrival_time = 0.0
    assert slo.batch_cap([Waiting()], now=0.2) == 4
    assert slo.batch_cap([Waiting()], now=0.6) == 16  # the queue is eating the TTFT budget: throughput first
    with pytest.raises(ValueError):
        SloController((1,), 1, tpot_slo=-1)


def test_slo_policy_keeps_outputs_and_runs(tiny_dir, one_at_a_time):
    reqs, want = one_at_a_time
    llm = make_llm(tiny_dir, tpot_slo=10.0, ttft_slo=100.0)
    assert token_ids(llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)) == want
    assert llm.scheduler.slo.step_seconds  # step times were measured
    llm.core.assert_idle_and_clean()


def test_next_step_is_dispatched_before_the_previous_is_read():
    llm = fake_llm()
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=30, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == list(range(6, 36))
    events = llm.runner.events
    fetches = [i for i, e in enumerate(events) if e == "fetch"]
    assert len(fetches) == 30  # one blocking copy per step
    waited = [i for i in fetches if events[i - 1] != "dispatch"]
    assert len(waited) == 1  # only the last step had no successor to overlap with


def test_a_failed_step_leaves_the_engine_clean():
    llm = fake_llm()
    ps = prompts(np.random.default_rng(), [9, 14], vocab_size=64)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = token_ids(llm.generate(ps, sp, use_tqdm=False))
    dispatched = len(llm.runner.steps)
    llm.runner.fail("dispatch", lambda rows: len(llm.runner.steps) == dispatched + 2)  # the third step
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(ps, sp, use_tqdm=False)
    llm.core.assert_idle_and_clean()
    # Nothing half-written was published to the prefix cache: the same prompts give the same tokens.
    assert token_ids(llm.generate(ps, sp, use_tqdm=False)) == want


def test_pages_reach_the_prefix_cache_only_after_their_step_completed():
    """A step that fails on the device (its fetch raises) may not have written its pages: none of them may be
    served to a later request as a cached prefix."""
    llm = fake_llm()
    p = prompts(np.random.default_rng(), [13], vocab_size=64)  # three full pages of 4 tokens
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.runner.fail("fetch")
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(p, sp, use_tqdm=False)
    llm.core.assert_idle_and_clean()
    assert llm.scheduler.cache.num_cached == 0
    before = llm.stats().prefix_cache_hits
    llm.generate(p, sp, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == before  # nothing was served from the failed step
    assert llm.scheduler.cache.num_cached == 3  # and the completed prefill published its full pages


def test_prompt_chunks_are_cut_to_a_bucket_rather_than_padded_far():
    """300 planned tokens would pad to 512: the last chunks are cut to make 256 (the rest runs next step); 400
    would pad a quarter or less, and a small step pads freely; decode tokens are never cut."""
    from types import SimpleNamespace

    from jaxserve.batching.scheduler import Scheduler
    from jaxserve.batching.step_plan import Chunk, ScheduledBatch
    from jaxserve.cache import PageAllocator, PrefixCache
    scheduler = Scheduler(PrefixCache(PageAllocator(8), 4), 64, 512, (1, 4, 8, 16, 32, 64, 128, 256, 512))
    seq = SimpleNamespace(token_ids=[0] * 1000)

    def fit(decodes, chunk_lengths):
        plan = ScheduledBatch([seq] * decodes, [Chunk(seq, 0, n) for n in chunk_lengths])
        scheduler._fit_to_bucket(plan)
        return [c.length for c in plan.prefill]

    assert fit(10, [200, 90]) == [200, 46]  # 300 -> 256
    assert fit(10, [30, 260]) == [30, 216]
    assert fit(0, [100, 100, 100]) == [100, 100, 56]
    assert fit(10, [300, 90]) == [300, 90]  # 400 of 512: padded
    assert fit(3, [40]) == [40]  # 43 tokens: below compute-bound, padded to 64
    assert fit(280, [20]) == [20]  # the decodes alone exceed the bucket below
    assert fit(10, [20, 100, 40, 10]) == [20, 98]  # 180 -> 128: the last chunks go, one is cut


def test_generation_rate_counts_the_steps_within_its_window(monkeypatch):
    """stats().generation_tokens_per_s: the tokens of the steps in the last rate_window_s seconds over their span;
    steps older than the window drop out."""
    from jaxserve.batching import engine_core
    from jaxserve.batching.sequence import Sequence

    from fake_runner import fake_replica
    clock = [100.0]
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    core = fake_replica(async_scheduling=False)
    core.add(Sequence("a", 0, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), 0, 64, []))
    core.step()  # the prompt, and the first token
    for _ in range(6):
        clock[0] += 0.5
        core.step()  # one token each
    assert core.stats().generation_tokens_per_s == pytest.approx(6 / 3.0)
    clock[0] += 10.0  # past the window (5 s): the steps before drop out
    core.step()
    clock[0] += 0.25
    core.step()
    assert core.stats().generation_tokens_per_s == pytest.approx(1 / 0.25)
