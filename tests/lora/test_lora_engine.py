"""LoRA adapters above the runner, over fake runners (tests/fake_runner.py: an adapter "shift/N" adds N to every
successor): the scheduler's slots, preemption, speculation, the prefix cache, data parallelism and bad input."""
import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import AsyncEngine, SamplingParams
from jaxserve.lora.adapter import LoRAError
from jaxserve.lora.request import LoRARequest

from fake_runner import fake_llm

VOCAB = 64
ADAPTERS = [None] + [LoRARequest(f"shift{n}", n, f"shift/{n}") for n in (1, 2, 3, 5)]


def expected(prompt: list[int], lora: LoRARequest | None, n: int) -> list[int]:
    """What a greedy fake sequence generates: each token the one before plus 1, plus its adapter's shift."""
    shift = 0 if lora is None else int(lora.lora_path.split("/")[1])
    out, t = [], prompt[-1]
    for _ in range(n):
        t = (t + 1 + shift) % VOCAB
        out.append(t)
    return out


@pytest.fixture(scope="module", params=["plain", "ngram"])
def lora_llm(request):
    """Two slots for four adapters (three on the host), 16 usable pages: slots are refilled and sequences preempted
    often; and the same speculating for every sequence every step (verification rows on adapters)."""
    return fake_llm(max_num_seqs=3, max_num_batched_tokens=8, num_pages=17, max_model_len=64, vocab_size=VOCAB,
                    max_loras=2, max_cpu_loras=3, **({"ngram": 3} if request.param == "ngram" else {}))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_adapters_batched_with_the_base_model(lora_llm, data):
    llm, core, sched = lora_llm, lora_llm.core, lora_llm.scheduler
    for s in sched.waiting + sched.running:  # left by an example hypothesis cut short
        core.abort(s.request_id)
    while core.has_unfinished():
        core.step()
    llm.reset_prefix_cache()  # an example must draw the same when replayed
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shared = rng.integers(0, 4, 12).tolist()  # one prefix under several adapters: pages must not be shared
    requests = []
    for i in range(data.draw(st.integers(1, 7))):
        n = int(rng.integers(2, 20))
        prompt = (shared + rng.integers(0, VOCAB, n).tolist())[:max(n, 2)] if i % 2 else \
            rng.integers(0, VOCAB, n).tolist()
        lora = ADAPTERS[data.draw(st.integers(0, len(ADAPTERS) - 1))]
        sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 25)), ignore_eos=True)
        requests.append(llm.add_request({"prompt_token_ids": prompt}, sp, lora_request=lora))
    aborted = set()
    for _ in range(400):
        if not core.has_unfinished():
            break
        if data.draw(st.integers(0, 14)) == 0:  # an abort at any point: waiting, mid-prefill, decoding
            r = requests[data.draw(st.integers(0, len(requests) - 1))]
            core.abort(r.request_id)
            aborted.add(r.request_id)
        core.step()
        running = {s.lora.key for s in sched.running if s.lora is not None}
        assert sched.lora_slots.num_in_use() == len(running) <= 2
        for s in sched.running:  # a running sequence's slot holds its adapter
            assert (s.lora_slot >= 0) == (s.lora is not None)
            if s.lora is not None:
                assert llm.runner.lora_shifts[s.lora_slot] == s.lora.adapter.shift
    core.assert_idle_and_clean()
    assert sched.lora_slots.num_in_use() == 0
    for r in requests:
        if r.request_id not in aborted:
            seq = r.seqs[0]
            assert seq.output_token_ids == expected(r.prompt_token_ids, seq.lora_request, seq.params.max_tokens)


def test_prefix_cache_keys_pages_by_adapter():
    llm = fake_llm(vocab_size=VOCAB, max_loras=2)
    prompt = {"prompt_token_ids": list(range(1, 14))}  # three full pages before the last token
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def hits(lora):
        before = llm.stats().prefix_cache_hits
        out = llm.generate(prompt, sp, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == expected(prompt["prompt_token_ids"], lora, 2)
        return llm.stats().prefix_cache_hits - before
    a, b, a_too = ADAPTERS[1], ADAPTERS[2], LoRARequest("same-weights", 9, ADAPTERS[1].lora_path)
    assert [hits(a), hits(b), hits(None), hits(a), hits(b), hits(None)] == [0, 0, 0, 12, 12, 12]
    assert hits(a_too) == 12  # another id of the same weights: the same KV
    llm.core.assert_idle_and_clean()


def test_waiting_adapters_are_not_starved_and_the_base_model_goes_on():
    """One slot: a stream of requests on adapter 1 never keeps a request on adapter 2 out for long, and base
    requests run while the slot is taken."""
    llm = fake_llm(vocab_size=VOCAB, max_loras=1, max_num_seqs=4, max_model_len=96)
    core = llm.core
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.add_request({"prompt_token_ids": [3, 4]}, sp, lora_request=ADAPTERS[1])
    core.step()
    other = llm.add_request({"prompt_token_ids": [5, 6]}, sp, lora_request=ADAPTERS[2])
    base = llm.add_request({"prompt_token_ids": [7, 8]}, sp)
    for step in range(200):
        if len(core.scheduler.waiting) < 2:  # a steady stream on the loaded adapter
            llm.add_request({"prompt_token_ids": [1, 2]}, sp, lora_request=ADAPTERS[1])
        core.step()
        if step == 1:
            assert base.seqs[0] in core.scheduler.running  # the base model needs no slot
        if other.seqs[0].finished:
            break
    assert other.seqs[0].output_token_ids == expected([5, 6], ADAPTERS[2], 6)
    assert first.seqs[0].finished and base.seqs[0].finished
    for s in core.scheduler.waiting + core.scheduler.running:
        core.abort(s.request_id)
    while core.has_unfinished():
        core.step()
    core.assert_idle_and_clean()


def test_data_parallel_replicas_load_their_own_slots():
    llm = fake_llm(num_replicas=2, vocab_size=VOCAB, max_loras=1, max_cpu_loras=4)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i, i + 1]} for i in range(6)]
    loras = [ADAPTERS[1 + i % 3] if i < 5 else None for i in range(6)]
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    for p, lora, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == expected(p["prompt_token_ids"], lora, 5)
    assert all(r.scheduler.lora_slots.num_loads for r in llm.replicas)
    llm.core.assert_idle_and_clean()


def test_bad_adapter_requests_fail_cleanly():
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = fake_llm(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="'shift1'.*enable_lora"):
        plain.generate({"prompt_token_ids": [1, 2]}, sp, use_tqdm=False, lora_request=ADAPTERS[1])
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_lora(ADAPTERS[1])
    llm = fake_llm(vocab_size=VOCAB, max_loras=1, max_cpu_loras=2)
    running = llm.add_request({"prompt_token_ids": [1, 2]}, sp, lora_request=ADAPTERS[1])
    llm.step()
    with pytest.raises(LoRAError, match="'broken'"):
        llm.add_request({"prompt_token_ids": [3, 4]}, sp, lora_request=LoRARequest("broken", 7, "nowhere"))
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.add_request({"prompt_token_ids": [3, 4]}, sp, lora_request="shift1")
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate({"prompt_token_ids": [3, 4]}, sp, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'shift1'"):
        llm.add_lora(LoRARequest("other", 1, "shift/4"))
    while llm.has_unfinished_requests():
        llm.step()
    assert running.seqs[0].output_token_ids == expected([1, 2], ADAPTERS[1], 8)
    llm.core.assert_idle_and_clean()
    # The host's adapters at run time (vLLM's names): a removed one is loaded again by the next request naming it.
    assert llm.add_lora(ADAPTERS[2]) and llm.list_loras() == {1, 2}
    assert llm.remove_lora(1) and not llm.remove_lora(1) and llm.list_loras() == {2}
    out = llm.generate({"prompt_token_ids": [1, 2]}, sp, use_tqdm=False, lora_request=ADAPTERS[1])[0]
    assert out.outputs[0].token_ids == expected([1, 2], ADAPTERS[1], 8) and llm.list_loras() == {1, 2}


def test_async_engine_runs_adapters_and_manages_them():
    engine = AsyncEngine(fake_llm(vocab_size=VOCAB, max_loras=1, max_cpu_loras=2))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        assert await engine.add_lora(ADAPTERS[2]) and await engine.list_loras() == {2}
        streams = [await engine.add_request({"prompt_token_ids": [i, i + 1]}, sp, lora_request=lora)
                   for i, lora in enumerate([ADAPTERS[1], None, ADAPTERS[2]])]
        with pytest.raises(LoRAError, match="'broken'"):
            await engine.add_request({"prompt_token_ids": [1, 2]}, sp, lora_request=LoRARequest("broken", 7, "x"))
        tokens = []
        for s in streams:
            tokens.append([t async for out in s for t in out.outputs[0].token_ids])
        removed = await engine.remove_lora(2)
        return tokens, removed, await engine.list_loras()

    try:
        tokens, removed, left = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens == [expected([i, i + 1], lora, 6) for i, lora in enumerate([ADAPTERS[1], None, ADAPTERS[2]])]
    assert removed and left == {1}
    engine.llm.core.assert_idle_and_clean()


def test_several_processes_refuse_enable_lora(monkeypatch):
    """Followers would have to load each adapter into the leader's slot: refused before any model loads."""
    from jaxserve import LLM, multihost
    monkeypatch.setattr(multihost.LeaderFollower, "for_this_process",
                        classmethod(lambda cls, *a: cls(object(), True)))  # a leader with a channel
    with pytest.raises(ValueError, match="enable_lora is not supported over several processes"):
        LLM("/nonexistent-model", enable_lora=True)
