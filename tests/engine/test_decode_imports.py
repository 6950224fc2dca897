"""A decode engine's KV imports off its step loop (issue 53): the pages a request brings are staged on the KV import
thread before the engine thread sees them, so decode rows keep stepping while an import is held mid-way; the engine
thread then admits one import a step; imported sequences give the colocated tokens; pages that do not fit are refused
before anything is held. Over fake runners, held at gates (no timing)."""
import asyncio
import os
import threading

import numpy as np
import pytest

from jaxserve import LLM, AsyncEngine, SamplingParams
from jaxserve.batching.sequence import Status
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import trimmed
from jaxserve.engine.client import Prefilled
from jaxserve.engine.factory import EngineParts
from jaxserve.kv_transfer.worker import import_executor

from fake_runner import fake_llm, fake_replica

VOCAB = 64
TIMEOUT_S = 30  # a guard against a hang only: every wait below ends on an event


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prefilled(prompt: list[int], sp: SamplingParams) -> Prefilled:
    """prompt prefilled on a fake prefill engine: its pages on the host (as a server sends them) and first token."""
    llm = LLM.over(EngineParts.over([fake_replica(vocab_size=VOCAB, role="prefill")], VOCAB, 64))
    llm.add_request({"prompt_token_ids": prompt}, sp)
    while not llm.scheduler.handed_off:
        llm.step()
    (hand_off,) = llm.core.take_handed_off()
    kv = trimmed(hand_off.kv, pages_needed(hand_off.num_cached, llm.scheduler.page_size))
    return Prefilled(kv, hand_off.num_cached, hand_off.seq.output_token_ids[0], 0.0)


def colocated(prompt: list[int], sp: SamplingParams) -> list[int]:
    return fake_llm(vocab_size=VOCAB).generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids


async def tokens_of(stream) -> list[int]:
    return [t async for out in stream for c in out.outputs for t in c.token_ids]


class Gate:
    """Holds the first call of fn once armed, on whatever thread makes it, until opened."""

    def __init__(self, fn):
        self.fn, self.armed = fn, False
        self.entered, self.opened = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args):
        if self.armed and not self.entered.is_set():
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.opened.wait(TIMEOUT_S), "the gate was never opened"
        return self.fn(*args)


@pytest.fixture
def decode():
    engine = AsyncEngine(fake_llm(vocab_size=VOCAB, role="decode"))
    yield engine
    engine.shutdown()


def test_decode_rows_keep_stepping_while_an_import_is_held_mid_way(decode):
    """Request a decodes; b's pages are held in their host-to-device staging; a runs to its end meanwhile, and b,
    released, gives the colocated tokens. (With the staging on the engine thread, a's steps would wait for b.)"""
    runner = decode.llm.core.runner
    gate = runner.put_pages = Gate(runner.put_pages)
    sp_a, sp_b = sampling(40), sampling(9)
    prompt_a, prompt_b = [5, 6, 7], [1, 2, 3, 4, 5, 6]

    async def run():
        loop = asyncio.get_running_loop()
        stream_a = await decode.add_request({"prompt_token_ids": prompt_a}, sp_a, request_id="a",
                                            prefilled=prefilled(prompt_a, sp_a))
        first = await anext(stream_a)  # a is decoding
        gate.armed = True
        b = asyncio.create_task(decode.add_request({"prompt_token_ids": prompt_b}, sp_b, request_id="b",
                                                   prefilled=prefilled(prompt_b, sp_b)))
        assert await loop.run_in_executor(None, gate.entered.wait, TIMEOUT_S), "b's import never started"
        rest_a = await asyncio.wait_for(tokens_of(stream_a), TIMEOUT_S)  # every step of a, b held throughout
        assert not gate.opened.is_set() and not b.done()
        gate.opened.set()
        tokens_b = await asyncio.wait_for(tokens_of(await b), TIMEOUT_S)
        return first.outputs[0].token_ids + rest_a, tokens_b

    tokens_a, tokens_b = asyncio.run(run())
    assert gate.threads[0].startswith("jaxserve-kv-import")
    assert tokens_a == colocated(prompt_a, sp_a)[1:]
    assert tokens_b == colocated(prompt_b, sp_b)[1:]
    decode.llm.core.assert_idle_and_clean()


def test_pages_that_do_not_fit_are_refused_on_the_import_thread_and_nothing_is_held(decode):
    sp = sampling(5)
    good = prefilled([1, 2, 3, 4, 5, 6], sp)
    short = Prefilled([(k[:1], v[:1]) for k, v in good.kv], good.num_cached, good.first_token, 0.0)
    other_dtype = Prefilled([(k.astype(np.float64), v.astype(np.float64)) for k, v in good.kv], good.num_cached,
                            good.first_token, 0.0)

    async def run():
        for bad, match in [(short, "need 2 KV pages, got 1"), (other_dtype, "do not fit")]:
            with pytest.raises(ValueError, match="request bad: .*" + match):
                await decode.add_request({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, sp, request_id="bad",
                                         prefilled=bad)
        return await tokens_of(await decode.add_request({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, sp,
                                                        request_id="bad", prefilled=good))

    assert asyncio.run(run()) == colocated([1, 2, 3, 4, 5, 6], sp)[1:]
    decode.llm.core.assert_idle_and_clean()


def test_a_client_gone_while_its_pages_are_staged_leaves_nothing_behind(decode):
    runner = decode.llm.core.runner
    gate = runner.put_pages = Gate(runner.put_pages)
    gate.armed = True
    sp = sampling(5)

    async def run():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(decode.add_request({"prompt_token_ids": [1, 2, 3]}, sp, request_id="gone",
                                                      prefilled=prefilled([1, 2, 3], sp)))
        assert await loop.run_in_executor(None, gate.entered.wait, TIMEOUT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.opened.set()
        await loop.run_in_executor(import_executor(), lambda: None)  # the staging has ended

    asyncio.run(run())
    assert not decode._streams
    decode.llm.core.assert_idle_and_clean()


def test_one_import_a_step_and_each_gives_the_colocated_tokens():
    """Three sequences whose pages landed together are admitted one a step: the engine thread's work before a step
    is one sequence's scatter at most."""
    llm = fake_llm(vocab_size=VOCAB, role="decode")
    core = llm.core
    imports_per_step: list[int] = []
    import_pages, dispatch = core.runner.import_pages, core.runner.dispatch
    imported = [0]
    core.runner.import_pages = lambda ids, kv: imported.__setitem__(0, imported[0] + 1) or import_pages(ids, kv)

    def counting(rows):
        imports_per_step.append(imported[0])
        imported[0] = 0
        return dispatch(rows)
    core.runner.dispatch = counting
    sp = sampling(6)
    prompts = [[1, 2, 3], [10, 11, 12, 13, 14], [20, 21]]
    requests = []
    for i, prompt in enumerate(prompts):
        p = prefilled(prompt, sp)
        request = llm.make_request({"prompt_token_ids": prompt}, sp, request_id=str(i))
        core.add_prefilled(request.seqs[0], p.kv, p.num_cached, first_token=p.first_token)
        requests.append(request)
    while llm.has_unfinished_requests():
        llm.step()
    assert imports_per_step[:3] == [1, 1, 1] and sum(imports_per_step) == 3
    for prompt, request in zip(prompts, requests):
        assert request.seqs[0].status is Status.FINISHED
        assert request.seqs[0].output_token_ids == colocated(prompt, sp)
    core.assert_idle_and_clean()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities are Linux's")
def test_the_import_thread_runs_below_the_engines_priority():
    def niceness():
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    name, nice = import_executor().submit(niceness).result(TIMEOUT_S)
    assert name.startswith("jaxserve-kv-import") and nice > os.getpriority(os.PRIO_PROCESS, 0)
