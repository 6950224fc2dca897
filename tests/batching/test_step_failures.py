"""A failed step ends the requests it held and no others: what was read back before it still reaches its requests
(speculative rounds, data-parallel rounds), and over data parallelism a broken replica fails only its own requests,
leaves the routing after its failure streak and shows in /health and /metrics while the others serve on."""
import asyncio

import pytest

from jaxserve import AsyncEngine, SamplingParams
from jaxserve.batching.engine_core import MAX_FAILED_STEPS, EngineDeadError, StepError
from jaxserve.batching.speculation.ngram import NgramProposer

from fake_runner import both_schedulings, fake_llm, has_decode_row

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(autouse=True, params=[True, False], ids=["async", "sync"])
def scheduling(request, monkeypatch):
    """Every failure here, with the engine planning a step ahead and without (the CPU default)."""
    both_schedulings(request, monkeypatch)


class FailsOnce(NgramProposer):
    """Its first proposing fails. With requests a (one token) and b (twelve) prefilled together, that is in the
    round that first reads back: the round's read-back comes before its proposing, so a has just finished."""

    def __init__(self):
        super().__init__(2, 3, 1)
        self.failed = False

    def propose(self, batch):
        if not self.failed:
            self.failed = True
            raise RuntimeError("proposer lost")
        return super().propose(batch)


def speculating_llm():
    proposer = FailsOnce()
    return fake_llm(ngram=2, proposer=proposer), proposer


def test_a_request_finished_in_a_failed_speculative_round_still_ends():
    """Request a finishes at its first token, read back at the start of a speculative round whose proposing then
    fails: a's result reaches it (it used to be dropped with the round: a's stream never ended, its capacity stayed
    taken), b, which was in the failed round, gets the error; nothing is held afterwards."""
    llm, proposer = speculating_llm()
    llm.add_request({"prompt_token_ids": [5, 6, 7]}, SHORT, request_id="a")
    llm.add_request({"prompt_token_ids": [8, 9, 10, 11]}, GREEDY, request_id="b")
    with pytest.raises(StepError) as info:
        while llm.has_unfinished_requests():
            llm.step()
    assert proposer.failed
    done = {d.seq.request_id: d for d in info.value.changed}
    assert done["a"].completion.finish_reason == "length" and done["a"].token_ids == [8]  # 7's successor, by hand
    assert set(info.value.failed) == {"b"} and "proposer lost" in str(info.value.failed["b"])
    llm.core.assert_idle_and_clean()


def test_the_async_engine_ends_a_request_finished_in_a_failed_round():
    llm, proposer = speculating_llm()
    engine = AsyncEngine(llm)
    try:
        async def main():
            a = await engine.add_request({"prompt_token_ids": [5, 6, 7]}, SHORT, request_id="a")
            b = await engine.add_request({"prompt_token_ids": [8, 9, 10, 11]}, GREEDY, request_id="b")
            return await asyncio.wait_for(asyncio.gather(_collect(a), _collect(b), return_exceptions=True), 30)

        a, b = asyncio.run(main())
        assert proposer.failed
        assert a[0] == [8] and a[1] == ["length"], a
        assert isinstance(b, RuntimeError) and "proposer lost" in str(b)
        assert engine.alive() and engine.stats().num_running == 0
    finally:
        engine.shutdown()


async def _collect(stream):
    tokens, reasons = [], []
    async for out in stream:
        for c in out.outputs:
            tokens += c.token_ids
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return [tokens, reasons]


def test_an_engine_whose_decodes_all_fail_stops():
    """Prefills succeed, every step with a decode row fails when read back: each request fails after its first
    token, and after MAX_FAILED_STEPS of them the engine stops (a successful prefill used to reset the count, so
    it never did, failing every request while it looked healthy)."""
    llm = fake_llm()
    llm.runner.fail("fetch", has_decode_row, RuntimeError("decode lost"), times=-1)
    for i in range(MAX_FAILED_STEPS):
        assert llm.core.healthy
        llm.add_request({"prompt_token_ids": [5, 6, 7 + i]}, GREEDY)
        with pytest.raises(StepError):
            while llm.has_unfinished_requests():
                llm.step()
    assert not llm.core.healthy and llm.stats().num_replicas_healthy == 0
    with pytest.raises(EngineDeadError):
        llm.add_request({"prompt_token_ids": [5, 6]}, GREEDY)
    llm.core.assert_idle_and_clean()


def test_occasional_failures_between_one_token_answers_do_not_stop_the_engine():
    """Scoring-style requests (max_tokens 1) never decode; each one that finishes shows the engine serves, so
    failures between them never add up to a stop."""
    llm = fake_llm()
    for i in range(MAX_FAILED_STEPS + 2):
        llm.runner.fail("fetch")
        llm.add_request({"prompt_token_ids": [5, 6, 7 + i]}, SHORT)
        with pytest.raises(StepError):
            while llm.has_unfinished_requests():
                llm.step()
        assert llm.generate({"prompt_token_ids": [5, 6, 7 + i]}, SHORT, use_tqdm=False)[0].outputs[0].token_ids == \
            [8 + i]
    assert llm.core.healthy
    llm.core.assert_idle_and_clean()


# ---- data parallelism ----

def break_replica(llm, index: int, where: str = "fetch"):
    """Every step of replica `index` fails from now on (by default when its results are read, as device errors
    surface)."""
    llm.replicas[index].runner.fail(where, error=RuntimeError(f"replica {index} lost its device"), times=-1)


def test_a_failed_replica_spares_the_other_replicas_results():
    """Both replicas step in one round; the second fails. The first's results of that round (a finished request)
    are returned with the error, not dropped; only the second's requests end; the router forgets both."""
    llm = fake_llm(num_replicas=2)
    llm.add_request({"prompt_token_ids": [5, 6, 7]}, SHORT, request_id="a")
    llm.add_request({"prompt_token_ids": [8, 9, 10]}, GREEDY, request_id="b")
    assert llm.core._placed["a"] is llm.replicas[0] and llm.core._placed["b"] is llm.replicas[1]
    llm.step()  # both dispatch their first step
    break_replica(llm, 1)
    with pytest.raises(StepError) as info:
        llm.step()
    assert [(d.seq.request_id, d.completion.finish_reason) for d in info.value.changed] == [("a", "length")]
    assert set(info.value.failed) == {"b"}
    llm.step()  # replica 0 reads back its last (empty) step
    llm.core.assert_idle_and_clean()


def test_a_broken_replica_fails_only_its_requests_and_leaves_the_routing():
    """Replica 1 fails every step. Its requests fail; after MAX_FAILED_STEPS in a row it stops and takes no more
    requests (it used to be picked again and again, being the least loaded after its requests failed), while every
    request on replica 0 completes, before and after; a healthy replica's steps do not reset its streak."""
    llm = fake_llm(num_replicas=2)
    break_replica(llm, 1)
    outcomes = {}
    for round_ in range(MAX_FAILED_STEPS + 2):
        ids = [f"{round_}-{i}" for i in range(2)]
        for rid in ids:
            llm.add_request({"prompt_token_ids": [5, 6, 7 + round_]}, GREEDY, request_id=rid)
        while llm.has_unfinished_requests():
            try:
                for d in llm.step():
                    if d.finished:
                        outcomes[d.seq.request_id] = d.completion.finish_reason
            except StepError as e:
                outcomes.update({r: e.failed[r] for r in e.failed})
                for d in e.changed:
                    if d.finished:
                        outcomes[d.seq.request_id] = d.completion.finish_reason
    assert set(outcomes) == {f"{r}-{i}" for r in range(MAX_FAILED_STEPS + 2) for i in range(2)}
    errors = [r for r, o in outcomes.items() if isinstance(o, BaseException)]
    assert len(errors) == MAX_FAILED_STEPS, outcomes  # one per round until replica 1 stopped, none after
    assert isinstance(outcomes[errors[-1]], EngineDeadError)
    assert not llm.replicas[1].healthy and llm.replicas[0].healthy
    stats = llm.stats()
    assert (stats.num_replicas, stats.num_replicas_healthy) == (2, 1)
    assert llm.core.routed[1] == MAX_FAILED_STEPS
    llm.core.assert_idle_and_clean()


def test_health_and_metrics_show_a_stopped_replica_and_the_server_serves_on():
    import requests

    from serving import ServerThread, metric_samples

    llm = fake_llm(num_replicas=2)
    break_replica(llm, 1, "dispatch")
    st = ServerThread(llm, "tiny")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        codes = [requests.post(st.url + "/v1/completions", json=body, timeout=60).status_code for _ in range(8)]
        assert codes.count(500) + codes.count(503) == MAX_FAILED_STEPS and codes.count(200) == 8 - MAX_FAILED_STEPS
        assert all(requests.post(st.url + "/v1/completions", json=body, timeout=60).status_code == 200
                   for _ in range(3))
        health = requests.get(st.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "degraded", "stopped_replicas": {"tiny": 1}}
        samples = metric_samples(requests.get(st.url + "/metrics", timeout=10).text)
        label = frozenset(['model_name="tiny"'])
        assert samples["jaxserve:num_replicas", label] == 2 and samples["jaxserve:num_replicas_healthy", label] == 1
    finally:
        st.stop()


def test_the_router_hashes_a_prompt_once(monkeypatch):
    import jaxserve.batching.pools.data_parallel as dp
    calls = []
    page_keys = dp.page_keys
    monkeypatch.setattr(dp, "page_keys", lambda *a: calls.append(1) or page_keys(*a))
    llm = fake_llm(num_replicas=4)
    llm.add_request({"prompt_token_ids": list(range(40))}, GREEDY)
    assert len(calls) == 1
