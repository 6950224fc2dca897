"""When a request that arrives while a step runs gets its first token (issue 28): in the step after that one, with
async scheduling or without (a server plans the next step as the one in flight ends, or once it has run)."""
import asyncio
import threading
import time

import pytest

from jaxserve import AsyncEngine, SamplingParams

from fake_runner import fake_llm

LONG = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LATE_PROMPT = [40, 41, 42, 43, 44]


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the engine never got there"
        time.sleep(0.005)


def prefills_late(rows) -> bool:
    return any(list(r.token_ids) == LATE_PROMPT and r.start_pos == 0 for r in rows)


# Without async scheduling; with it; with it for stepping at once but a server's plan after the read-back (CPU's
# default: `jaxserve.engine.factory`).
SCHEDULINGS = {"off": dict(async_scheduling=False), "on": dict(async_scheduling=True),
               "server reads back first": dict(async_scheduling=True, plan_lead=None)}


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
def test_a_request_arriving_during_a_step_is_in_the_next_planned_step(scheduling):
    """Held in a step whose time is not known yet (the first), the engine plans the next once it has run, with
    async scheduling too: the request that came meanwhile is in it."""
    llm = fake_llm(max_num_batched_tokens=16, **SCHEDULINGS[scheduling])
    runner = llm.runner
    runner.gate = threading.Event()  # the step in flight runs until the test lets it
    engine = AsyncEngine(llm)
    try:
        async def main():
            first = await engine.add_request({"prompt_token_ids": [3, 4, 5]}, LONG)
            wait_for(lambda: runner.events.count("dispatch") == 1)
            await asyncio.sleep(0.05)  # the engine is held inside the step in flight
            planned = len(runner.steps)
            late = await engine.add_request({"prompt_token_ids": LATE_PROMPT}, LONG)
            await asyncio.sleep(0.05)  # its command is queued while the engine is held
            assert len(runner.steps) == planned  # nothing planned while the first step runs
            runner.gate.set()
            outs = await asyncio.gather(collect(first), collect(late))
            return planned, outs

        planned, (first, late) = asyncio.run(asyncio.wait_for(main(), 60))
        assert first == list(range(6, 18)) and late == list(range(45, 57))
        steps = [prefills_late(rows) for rows in runner.steps]
        assert steps.index(True) == planned == 1, (steps, planned)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("scheduling", ["on", "server reads back first"])
def test_a_server_with_async_scheduling_plans_as_the_step_in_flight_ends(scheduling):
    """With async scheduling a server plans each step just before the step in flight is predicted to end: a request
    that comes early in a step runs in the step after it (planned right after the dispatch, it would wait one
    more), and the next step is on the device before the one in flight ends (the device never waits for the
    host). Reading back first (CPU's default for servers), the same request runs as soon, and each step is planned
    once the one before has ended."""
    llm = fake_llm(max_num_batched_tokens=16, **SCHEDULINGS[scheduling])
    runner = llm.runner
    runner.step_seconds = 0.2
    if llm.core.plan_lead is not None:
        llm.core.plan_lead = (1.25, 0.03)  # room for a busy machine's late wake-ups
    engine = AsyncEngine(llm)
    try:
        async def main():
            first = await engine.add_request({"prompt_token_ids": [3, 4, 5]}, LONG)
            wait_for(lambda: len(runner.device_times) >= 6)  # timed decode steps
            start = runner.device_times[-1][1]
            await asyncio.sleep(max(0.0, start + 0.02 - time.perf_counter()))  # early in that step
            arrived = time.perf_counter()
            late = await engine.add_request({"prompt_token_ids": LATE_PROMPT}, LONG)
            outs = await asyncio.gather(collect(first), collect(late))
            return arrived, outs

        arrived, (first, late) = asyncio.run(asyncio.wait_for(main(), 60))
        assert first == list(range(6, 18)) and late == list(range(45, 57))
        times = runner.device_times
        running = max(i for i, (_, start, _) in enumerate(times) if start <= arrived)  # the last begun
        assert [prefills_late(rows) for rows in runner.steps].index(True) == running + 1, (running, times)
        # Dispatched before the step before it ended, from the first steps whose time was known.
        ahead = [dispatched < end for (_, _, end), (dispatched, _, _) in zip(times[2:], times[3:])]
        if scheduling == "on":  # all but a step of a shape not timed yet and the odd late wake-up
            assert sum(ahead) >= 0.6 * len(ahead), ahead
        else:
            assert not any(ahead), ahead
    finally:
        engine.shutdown()


def test_stepping_at_once_plans_ahead_where_a_server_reads_back_first():
    """CPU's default (async scheduling, servers reading back first): stepping without waits, as generate() does,
    dispatches each step before the one before is read back."""
    llm = fake_llm(max_num_batched_tokens=16, **SCHEDULINGS["server reads back first"])
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}], LONG, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == list(range(6, 18))
    events = [e for e in llm.runner.events if e in ("dispatch", "fetch")]
    assert events[:5] == ["dispatch", "dispatch", "fetch", "dispatch", "fetch"], events


async def collect(stream) -> list[int]:
    tokens = []
    async for out in stream:
        tokens += out.outputs[0].token_ids
    return tokens


def test_a_failed_step_seen_while_waiting_ends_only_its_requests():
    """wait_in_flight leaves a failure to step(), which ends the failed step's requests: one that arrived while the
    engine waited on that step goes on."""
    llm = fake_llm(async_scheduling=False)
    runner = llm.runner
    runner.fail("fetch", lambda rows: any(list(r.token_ids) == [3, 4, 5] for r in rows))
    runner.gate = threading.Event()
    engine = AsyncEngine(llm)
    try:
        async def main():
            failing = await engine.add_request({"prompt_token_ids": [3, 4, 5]}, LONG)
            wait_for(lambda: runner.events.count("dispatch") == 1)
            await asyncio.sleep(0.05)  # the engine is held waiting on the step that fails
            arrived = await engine.add_request({"prompt_token_ids": [7, 8]}, LONG)
            await asyncio.sleep(0.05)
            runner.gate.set()
            with pytest.raises(RuntimeError, match="device lost"):
                await collect(failing)
            return await collect(arrived)

        assert asyncio.run(asyncio.wait_for(main(), 60)) == list(range(9, 21))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("given, planned_ahead", [(None, True), (True, True), (False, False)])
def test_on_cpu_generate_plans_ahead_and_a_server_reads_back_first_unless_asked(tiny_dir, given, planned_ahead):
    """The engine as built: on CPU by default generate() plans ahead and a server reads back first (plan_lead
    None); --async-scheduling: a server plans ahead too; --no-async-scheduling: neither does."""
    from tiny import make_llm
    llm = make_llm(tiny_dir, async_scheduling=given)
    assert llm.core.async_scheduling is planned_ahead
    assert (llm.core.plan_lead is None) == (given is None)
    events = []
    real_fetch, real_dispatch = llm.runner.fetch, llm.runner.dispatch
    llm.runner.fetch = lambda handle: events.append("fetch") or real_fetch(handle)
    llm.runner.dispatch = lambda rows: events.append("dispatch") or real_dispatch(rows)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # Ahead: two steps out at once (the next dispatched before the last is read back); else one at most.
    outstanding = [events[:i + 1].count("dispatch") - events[:i + 1].count("fetch") for i in range(len(events))]
    assert max(outstanding) == (2 if planned_ahead else 1), events


@pytest.mark.parametrize("at_risk", [False, True, "said"])
def test_a_prompt_whose_ttft_is_at_risk_gets_its_chunk_before_proposals(at_risk):
    """Speculation's proposals take the budget after the decodes and before waiting prompts; a prompt that has used
    half its TTFT budget keeps its first chunk's share (at most half the budget) from them. Not a sequence whose
    first token is out ("said": one preempted, say), however long it has waited."""
    from jaxserve.batching.slo import SloController
    llm = fake_llm(max_num_seqs=4, max_num_batched_tokens=8, async_scheduling=False)
    s = llm.core.scheduler
    s.slo = SloController((1, 2, 4), 4, ttft_slo=1.0)
    for first in (3, 13, 23):
        llm.add_request({"prompt_token_ids": [first, first + 1]}, LONG)
    llm.step()  # their prompts
    llm.step()  # read back: each has its first token and decodes next
    late = llm.add_request({"prompt_token_ids": LATE_PROMPT}, LONG).request_id
    if at_risk:
        for seq in s.waiting:
            seq.arrival_time -= 0.6  # past half the TTFT target
            if at_risk == "said":
                seq.output_token_ids.append(0)  # as a preempted sequence, back in the queue
    at_risk = at_risk is True
    plan = s.schedule({seq: 3 for seq in s.running})
    assert len(plan.decode) == 3
    chunk = [c.length for c in plan.prefill if c.seq.request_id == late]
    # 8 = 3 decodes + 5 proposals, or 3 decodes + 1 proposal + 4 (half the budget) of the prompt's 5 tokens.
    assert sum(plan.num_draft.values()) == (1 if at_risk else 5)
    assert chunk == ([4] if at_risk else []), chunk


def test_a_prompt_whose_ttft_is_at_risk_gets_its_chunk_before_some_decodes():
    """Where the decodes leave a prompt less than its share, the newest decodes wait a step."""
    from jaxserve.batching.slo import SloController
    llm = fake_llm(max_num_seqs=4, max_num_batched_tokens=4, async_scheduling=False)
    s = llm.core.scheduler
    s.slo = SloController((1, 2, 4), 4, ttft_slo=1.0)
    for first in (3, 13, 23):
        llm.add_request({"prompt_token_ids": [first]}, LONG)
    llm.step()
    llm.step()
    late = llm.add_request({"prompt_token_ids": LATE_PROMPT}, LONG).request_id
    (seq,) = s.waiting
    seq.arrival_time -= 0.6  # past half the TTFT target
    plan = s.schedule()
    assert [(c.seq.request_id, c.length) for c in plan.prefill] == [(late, 2)]  # not 1: 3 decodes + 1
    assert len(plan.decode) == 2


def test_no_budget_is_kept_for_a_prompt_that_cannot_run():
    """A prompt at risk with no pages free for it keeps nothing from the decodes: it could not use it."""
    from jaxserve.batching.slo import SloController
    llm = fake_llm(max_num_seqs=4, max_num_batched_tokens=4, async_scheduling=False, num_pages=16)  # 15 usable
    s = llm.core.scheduler
    s.slo = SloController((1, 2, 4), 4, ttft_slo=1.0)
    for first in (3, 13, 23):
        llm.add_request({"prompt_token_ids": list(range(first, first + 8))}, LONG)
    for _ in range(20):
        if len(s.running) == 3 and all(q.output_token_ids for q in s.running):
            break
        llm.step()
    assert s.cache.num_available <= 6  # each holds 3 pages or more
    llm.add_request({"prompt_token_ids": list(range(30, 60))}, LONG)  # 8 pages
    (seq,) = s.waiting
    seq.arrival_time -= 0.6
    assert s._prompt_reserve() == 0
    assert len(s.schedule().decode) == 3  # not 2, as a reserve of 2 of the 4 tokens would leave


def test_data_parallel_replicas_planning_just_in_time_are_all_planned_before_their_steps_end():
    """Behind data parallelism the replicas that plan just in time wait together (until the earliest of their
    planning times), and each has its next step on its device before the one in flight ends."""
    llm = fake_llm(num_replicas=2, max_num_batched_tokens=16, async_scheduling=True)
    for core in llm.replicas:
        core.runner.step_seconds = 0.1
        core.plan_lead = (1.25, 0.03)  # room for a busy machine's late wake-ups
    engine = AsyncEngine(llm)
    try:
        async def main():
            streams = [await engine.add_request({"prompt_token_ids": p}, LONG) for p in ([3, 4, 5], [20, 21])]
            return await asyncio.gather(*map(collect, streams))

        outs = asyncio.run(asyncio.wait_for(main(), 60))
        assert outs == [list(range(6, 18)), list(range(22, 34))]
        for core in llm.replicas:
            times = core.runner.device_times
            assert len(times) >= 10  # each replica ran a request
            ahead = [dispatched < end for (_, _, end), (dispatched, _, _) in zip(times[2:], times[3:])]
            assert sum(ahead) >= 0.6 * len(ahead), ahead
    finally:
        engine.shutdown()
