"""AsyncEngine on the tiny model: concurrent streams, abort by leaving the stream, bad input, stats."""
import asyncio
import time

import numpy as np
import pytest

from jaxserve import AsyncEngine, SamplingParams

from fake_runner import fake_llm, has_decode_row
from tiny import make_llm, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    engine = AsyncEngine(make_llm(tiny_dir))
    yield engine
    engine.shutdown()


async def collect(stream):
    """Joins a request's incremental outputs into (token ids, finish reason) per completion."""
    tokens, reasons = {}, {}
    async for out in stream:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            reasons[c.index] = c.finish_reason
    return [tokens[i] for i in sorted(tokens)], [reasons[i] for i in sorted(reasons)], out.finished


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while engine.llm.core.has_unfinished() or engine.stats().num_running:
        assert time.monotonic() < deadline, "engine never went idle"
        time.sleep(0.01)


def test_concurrent_requests_stream_what_generate_returns(engine, tiny_dir):
    ps = prompts(np.random.default_rng(), [3, 17, 9, 30])
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dir).generate(ps, GREEDY, use_tqdm=False)]

    async def main():
        streams = [await engine.add_request(p, GREEDY) for p in ps]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    assert [r[0][0] for r in results] == want
    assert all(r[1] == ["length"] and r[2] for r in results)
    wait_idle(engine)
    engine.llm.core.assert_idle_and_clean()
    assert engine.stats().generation_tokens >= 4 * 12


def test_n_completions_arrive_on_one_stream(engine):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)

    async def main():
        return await collect(await engine.add_request(prompts(np.random.default_rng(), [6])[0], sp))

    tokens, reasons, finished = asyncio.run(main())
    assert len(tokens) == 3 and all(len(t) == 5 for t in tokens) and finished


def test_leaving_a_stream_aborts_it_and_frees_its_pages(engine):
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    async def main():
        stream = await engine.add_request(prompts(np.random.default_rng(), [8])[0], long)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break  # a client gone mid-stream
        await stream.aclose()
        return got

    assert asyncio.run(main()) == 3
    wait_idle(engine)
    engine.llm.core.assert_idle_and_clean()


def test_abort_by_id_ends_the_stream(engine):
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    async def main():
        stream = await engine.add_request(prompts(np.random.default_rng(), [8])[0], long, request_id="to-abort")
        first = await stream.__anext__()
        engine.abort("to-abort")
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished
    assert sum(len(c.token_ids) for out in [first] + rest for c in out.outputs) < 80
    wait_idle(engine)
    engine.llm.core.assert_idle_and_clean()


def test_bad_requests_raise_before_queueing(engine):
    async def main():
        for bad in [{"prompt_token_ids": []}, {"prompt_token_ids": [999]}, 42]:
            with pytest.raises((ValueError, TypeError)):
                await engine.add_request(bad, GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request({"prompt_token_ids": [1] * 96}, GREEDY)
        with pytest.raises(TypeError):
            await engine.add_request({"prompt_token_ids": [1, 2]}, {"max_tokens": 3})
        # Still serving.
        return await collect(await engine.add_request({"prompt_token_ids": [1, 2]}, GREEDY))

    assert len(asyncio.run(main())[0][0]) == 12


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on():
    llm = fake_llm()
    llm.runner.fail("dispatch", has_decode_row)
    engine = AsyncEngine(llm)
    try:
        async def main():
            with pytest.raises(RuntimeError, match="device lost"):
                await collect(await engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY))
            return await collect(await engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY))

        assert asyncio.run(main())[0][0] == list(range(8, 20))
        wait_idle(engine)
        engine.llm.core.assert_idle_and_clean()
    finally:
        engine.shutdown()


def test_a_failed_step_spares_the_requests_still_waiting():
    """One sequence runs at a time: the running request fails with its step, the waiting one was in no step and
    completes."""
    llm = fake_llm(max_num_seqs=1)
    llm.runner.fail("dispatch", has_decode_row)
    engine = AsyncEngine(llm)
    try:
        async def main():
            first = await engine.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
            second = await engine.add_request({"prompt_token_ids": [8, 9]}, GREEDY)
            return await asyncio.gather(collect(first), collect(second), return_exceptions=True)

        first, second = asyncio.run(main())
        assert isinstance(first, RuntimeError) and "device lost" in str(first)
        assert second[0][0] == list(range(10, 22)) and second[2]
        wait_idle(engine)
        engine.llm.core.assert_idle_and_clean()
    finally:
        engine.shutdown()


def test_a_failed_step_ends_every_request_it_held():
    """A sequence preempted while its token was in flight, then that step fails: its request ends with the error
    (it used to wait forever for a token that never lands, the engine thread spinning), the rest complete."""
    llm = fake_llm(max_num_seqs=4, max_num_batched_tokens=16, num_pages=13, max_model_len=48)
    sched = llm.scheduler
    # The first read-back while a preempted sequence waits with its token in flight fails.
    fault = llm.runner.fail("fetch", lambda rows: any(s.pending for s in sched.waiting))
    engine = AsyncEngine(llm)
    try:
        async def main():
            sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            streams = [await engine.add_request(p, sp) for p in prompts(np.random.default_rng(0), [9, 10, 11, 12],
                                                                          vocab_size=64)]
            return await asyncio.wait_for(asyncio.gather(*[collect(s) for s in streams], return_exceptions=True), 60)

        results = asyncio.run(main())
        assert fault.times == 0, "no sequence was preempted with a token in flight"
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all("device lost" in str(r) for r in failed)
        assert all(len(r[0][0]) == 20 for r in results if not isinstance(r, BaseException))
        wait_idle(engine)
        engine.llm.core.assert_idle_and_clean()
        assert engine.alive()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("where", ["dispatch", "fetch"])
def test_an_engine_that_keeps_failing_reports_dead(where):
    """Every step fails, when dispatched or (as device errors do) when its results are read: each request gets the
    error, and after a few failed steps in a row the engine stops and says so (alive() is False, new requests are
    refused) instead of failing forever."""
    from jaxserve.engine.async_engine import MAX_FAILED_STEPS, EngineDeadError
    llm = fake_llm()
    llm.runner.fail(where, times=-1)
    engine = AsyncEngine(llm)
    try:
        async def main():
            errors = []
            for _ in range(MAX_FAILED_STEPS):
                try:
                    await asyncio.wait_for(collect(await engine.add_request({"prompt_token_ids": [5, 6]}, GREEDY)), 30)
                except (RuntimeError, EngineDeadError) as e:
                    errors.append(e)
            return errors

        errors = asyncio.run(main())
        assert len(errors) == MAX_FAILED_STEPS and isinstance(errors[-1], EngineDeadError)
        engine._thread.join(10)
        assert not engine.alive()
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.add_request({"prompt_token_ids": [5, 6]}, GREEDY))
    finally:
        engine.shutdown(10)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_sequence_that_advances_twice_in_a_step_streams_one_output(max_tokens):
    """Speculating every step, a sequence advances twice in one engine step (the step before is read back, then the
    speculative one runs): its request still gets one output per completion per update and ends exactly once (the
    two used to be sent apart, each with the finish reason: the request's count of unfinished completions went
    below zero and its stream never ended)."""
    engine = AsyncEngine(fake_llm(ngram=3))
    try:
        async def main():
            sp = SamplingParams(n=2, temperature=0, max_tokens=max_tokens, ignore_eos=True)
            stream = await engine.add_request({"prompt_token_ids": [5, 6, 7]}, sp)
            return [out async for out in stream]

        outs = asyncio.run(asyncio.wait_for(main(), 30))
        for out in outs:
            assert len({c.index for c in out.outputs}) == len(out.outputs), out
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
        for index in (0, 1):
            mine = [c for out in outs for c in out.outputs if c.index == index]
            assert sum(t for c in mine for t in c.token_ids) == sum(range(8, 8 + max_tokens))
            assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    finally:
        engine.shutdown()
