"""Disaggregated prefill: a prefill pool hands each sequence off after its first token, with its KV pages, to a
decode pool. Over fake runners (whose cache records the token at each slot and fails a row that reads a slot never
written, so a missing or misplaced import shows) and the tiny model on CPU devices (whose tokens must equal a
colocated engine's)."""
import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.batching.engine_core import StepError
from jaxserve.batching.sequence import Status
from jaxserve.cache import pages_needed
from jaxserve.cache.transfer import kv_bytes, trimmed
from jaxserve.engine.factory import EngineParts
from jaxserve.tokenizer import Tokenizer

from fake_runner import fake_llm, fake_replica
from tiny import make_llm

VOCAB = 64
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def disaggregated_llm(num_prefill=1, num_decode=1, prefill_args=None, decode_args=None) -> LLM:
    prefill = [fake_replica(vocab_size=VOCAB, role="prefill", **(prefill_args or {})) for _ in range(num_prefill)]
    decode = [fake_replica(vocab_size=VOCAB, **(decode_args or {})) for _ in range(num_decode)]
    return LLM.over(EngineParts.over(prefill, VOCAB, 64, decode=decode))


def fake_requests(rng, n=8):
    reqs = []
    for i in range(n):
        ids = rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
        sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True, n=1 + (i % 3 == 1))
        reqs.append(({"prompt_token_ids": ids}, sp))
    return reqs


def outputs(llm, reqs):
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("num_decode", [1, 2])
def test_fake_pools_give_the_colocated_tokens_and_never_decode_on_the_prefill_side(num_decode):
    reqs = fake_requests(np.random.default_rng(0))
    want = outputs(fake_llm(vocab_size=VOCAB), reqs)
    llm = disaggregated_llm(1, num_decode)
    assert outputs(llm, reqs) == want
    prefill, decode = llm.replicas[0], llm.replicas[1:]
    # Pipelined, yet never a decode row: every row there computes prompt tokens and samples a first token at most.
    assert all(not r.chained and r.sampling.step == 0 for rows in prefill.runner.steps for r in rows)
    assert sum(len(d.runner.steps) for d in decode) > 0
    stats = llm.stats()
    assert stats.kv_transfers == sum(sp.n for _, sp in reqs if sp.max_tokens > 1)
    assert stats.kv_transfer_bytes > 0 and [p for p, _, _ in stats.pools] == ["prefill", "decode"]
    llm.core.assert_idle_and_clean()


def test_a_first_token_that_ends_the_request_is_not_handed_off():
    llm = disaggregated_llm()
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == [6]
    assert llm.stats().kv_transfers == 0 and not llm.replicas[1].runner.steps
    llm.core.assert_idle_and_clean()


def test_decode_out_of_pages_holds_the_hand_offs_on_the_prefill_side():
    """The decode pool holds two sequences at a time (7 usable pages of 4 tokens, 3 each): the others' pages stay
    on the prefill side, handed off, until decode can admit them (so they count in the prefill cache's budget);
    no KV copy ever waits on the decode side outside its cache's pages."""
    reqs = [({"prompt_token_ids": list(range(i, i + 9))}, SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True)) for i in range(12)]
    want = outputs(fake_llm(vocab_size=VOCAB), reqs)
    llm = disaggregated_llm(prefill_args=dict(max_num_seqs=8, max_num_batched_tokens=64),
                            decode_args=dict(num_pages=8))
    prefill, decode = llm.replicas[0].scheduler, llm.replicas[1].scheduler
    for p, sp in reqs:
        llm.add_request(p, sp)
    done, held, copies = {}, [], []
    while llm.has_unfinished_requests():
        for d in llm.step():
            done.setdefault(d.seq.request_id, []).extend(d.token_ids)
        held.append(len(prefill.handed_off))
        copies.append(len(decode._imports))  # KV copies on the decode side, not yet in its cache
    assert max(held) >= 4 and max(copies) <= 1
    assert llm.stats().decode_admitted == 12
    assert [done[r] for r in sorted(done, key=int)] == [w[0] for w in want]
    llm.core.assert_idle_and_clean()


@pytest.mark.parametrize("phase", ["prefilling", "waiting for decode pages", "decoding"])
def test_abort_in_each_phase_frees_every_page(phase):
    llm = disaggregated_llm(decode_args=dict(num_pages=8))
    hog = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # 6 of the decode's 7 pages at once
    llm.add_request({"prompt_token_ids": list(range(20))}, hog, request_id="hog")
    llm.add_request({"prompt_token_ids": list(range(10))}, GREEDY, request_id="r")
    prefill, decode = llm.replicas
    for _ in range(50):
        seqs = {s.request_id: s for s in decode.scheduler.waiting + decode.scheduler.running}
        if phase == "prefilling" and "r" in {s.request_id for s in prefill.scheduler.running}:
            break
        if phase == "waiting for decode pages" and "r" in {s.request_id for s in prefill.scheduler.handed_off} \
                and "hog" in seqs:  # held on the prefill side, its pages there
            break
        if phase == "decoding" and "r" in seqs and seqs["r"].status is Status.RUNNING:
            break
        llm.step()
    else:
        pytest.fail(f"never reached {phase}")
    llm.abort_request("r")
    while llm.has_unfinished_requests():
        llm.step()
    llm.core.assert_idle_and_clean()


def run_through_failures(llm) -> tuple[dict, dict]:
    """Steps llm to the end through failed steps: (request id -> its tokens, request id -> the error that ended it)."""
    failed, tokens = {}, {}
    while llm.has_unfinished_requests():
        try:
            deltas = llm.step()
        except StepError as e:
            deltas = e.changed
            failed.update(e.failed)
        for d in deltas:
            tokens.setdefault(d.seq.request_id, []).extend(d.token_ids)
    return tokens, failed


def test_a_failed_decode_step_ends_only_its_requests():
    llm = disaggregated_llm(num_decode=2)
    bad = llm.replicas[2].runner
    bad.fail("dispatch", times=-1)
    llm.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, request_id="a")
    llm.add_request({"prompt_token_ids": [4, 5, 6]}, GREEDY, request_id="b")
    tokens, failed = run_through_failures(llm)
    assert len(failed) == 1 and "device lost" in str(next(iter(failed.values())))
    ok = ({"a", "b"} - set(failed)).pop()
    assert len(tokens[ok]) == 10
    llm.core.assert_idle_and_clean()


def test_a_prefill_sequence_preempted_with_its_first_token_in_flight_is_handed_off_after_recomputing():
    """Priority policy, one slot: "low"'s whole prompt is dispatched, then "high" preempts it while its first token
    is in flight; low is handed off only once recomputed, and both give the colocated tokens."""
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = {"low": [1, 2, 3], "high": [7, 8, 9]}
    want = outputs(fake_llm(vocab_size=VOCAB), [({"prompt_token_ids": p}, sp) for p in prompts.values()])
    llm = disaggregated_llm(prefill_args=dict(scheduling_policy="priority", max_num_seqs=1))
    llm.add_request({"prompt_token_ids": prompts["low"]}, sp, priority=5, request_id="low")
    llm.step()
    llm.add_request({"prompt_token_ids": prompts["high"]}, sp, priority=0, request_id="high")
    got = {}
    while llm.has_unfinished_requests():
        for d in llm.step():  # a StepError fails the test
            got.setdefault(d.seq.request_id, []).extend(d.token_ids)
    assert llm.replicas[0].scheduler.num_preemptions == 1
    assert [[got["low"]], [got["high"]]] == want
    llm.core.assert_idle_and_clean()


def test_a_decode_server_takes_a_sequence_it_did_not_prefill(tiny_tokenized_dir):
    """Two engines as two servers would hold them: the prefill one's KV pages go through host memory (trimmed to
    the prompt's pages), and the decode one, given the first token, streams only the text after it."""
    tokenizer = Tokenizer.from_hf_dir(tiny_tokenized_dir)
    prompt, sp = "pages move", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    whole = fake_llm(vocab_size=320, tokenizer=tokenizer).generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    prefill = LLM.over(EngineParts.over([fake_replica(vocab_size=320, role="prefill")], 320, 64, tokenizer))
    prefill.add_request(prompt, sp)
    said = ""
    while not prefill.scheduler.handed_off:
        said += "".join(d.completion.text for d in prefill.step())
    (hand_off,) = prefill.core.take_handed_off()
    kv = trimmed(hand_off.kv, pages_needed(hand_off.num_cached, prefill.scheduler.page_size))
    decode = fake_llm(vocab_size=320, tokenizer=tokenizer)
    request = decode.make_request(prompt, sp)
    decode.core.add_prefilled(request.seqs[0], kv, hand_off.num_cached, first_token=hand_off.seq.output_token_ids[0])
    streamed, tokens = "", []
    while decode.has_unfinished_requests():
        for d in decode.step():
            streamed += d.completion.text
            tokens += d.token_ids
    assert said and said + streamed == whole.text
    assert hand_off.seq.output_token_ids + tokens == whole.token_ids
    assert request.seqs[0].output_token_ids == whole.token_ids
    prefill.core.assert_idle_and_clean()
    decode.core.assert_idle_and_clean()


def test_kv_pages_too_few_or_of_another_dtype_are_refused_before_anything_is_held():
    """A KV copy short of the pages its cached tokens fill (or of another dtype) is refused by add_prefilled, naming
    the request, instead of failing a decode step later (and every request of the replica with it)."""
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    decode = fake_llm(vocab_size=VOCAB)
    decode.add_request({"prompt_token_ids": [1, 2, 3]}, sp, request_id="innocent")
    for _ in range(3):
        decode.step()
    pages = np.arange(8).reshape(2, 4)  # 2 pages of 4 tokens: 10 cached tokens need 3
    for kv, match in [([(pages, pages)], "10 cached tokens need 3 KV pages, got 2"),
                      ([(np.zeros((3, 4), np.float32),) * 2], "do not fit")]:
        req = decode.make_request({"prompt_token_ids": list(range(10))}, sp, request_id="bad")
        with pytest.raises(ValueError, match="request bad: .*" + match):
            decode.core.add_prefilled(req.seqs[0], kv, 10, first_token=10)
    assert [s.request_id for s in decode.scheduler.waiting + decode.scheduler.running] == ["innocent"]
    with pytest.raises(ValueError, match="3 pages to import, the KV pages hold 2"):  # as the real runner
        decode.core.runner.import_pages([1, 2, 3], [(pages, pages)])
    while decode.has_unfinished_requests():
        decode.step()
    decode.core.assert_idle_and_clean()


# ---- the tiny model on CPU devices ----

def tiny_workload(rng):
    """Greedy and seeded-sampling requests (one with n=2), half sharing a prefix of several pages."""
    prefix = rng.integers(0, 320, 13).tolist()
    reqs = []
    for i in range(5):
        tail = rng.integers(0, 320, int(rng.integers(1, 15))).tolist()
        ids = prefix + tail if i % 2 else rng.integers(0, 320, int(rng.integers(1, 30))).tolist()
        if i % 3 == 2:
            sp = SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 30)), max_tokens=9, ignore_eos=True,
                                n=2 if i == 2 else 1)
        else:
            sp = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        reqs.append(({"prompt_token_ids": ids}, sp))
    return reqs


@pytest.fixture(scope="module")
def colocated(tiny_dir):
    """The workload's tokens from a colocated engine, per KV-cache dtype."""
    reqs = tiny_workload(np.random.default_rng(26))
    return reqs, {kv: outputs(make_llm(tiny_dir, kv_cache_dtype=kv), reqs) for kv in ("auto", "int8")}


@pytest.mark.parametrize("pools", [dict(prefill_replicas=1, decode_replicas=1, tensor_parallel_size=2,
                                        decode_tensor_parallel_size=1),
                                   dict(prefill_replicas=1, decode_replicas=2, decode_tensor_parallel_size=2,
                                        kv_cache_dtype="int8")],
                         ids=["P1D1-prefill-tp2", "P1D2-decode-tp2-int8"])
def test_pools_give_the_colocated_tokens(tiny_dir, colocated, pools):
    reqs, want = colocated
    llm = make_llm(tiny_dir, **pools)
    assert outputs(llm, reqs) == want[pools.get("kv_cache_dtype", "auto")]
    stats = llm.stats()
    assert stats.kv_transfers == sum(sp.n for _, sp in reqs if sp.max_tokens > 1) and stats.kv_transfer_bytes > 0
    assert stats.prefix_cache_hits > 0  # on the prefill side
    assert [p for p, _, _ in stats.pools] == ["prefill", "decode"]
    llm.core.assert_idle_and_clean()


def test_a_stream_gives_the_colocated_text(tiny_tokenized_dir):
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=14, ignore_eos=True)
    want = "".join(make_llm(tiny_tokenized_dir).stream("a prompt", sp))
    llm = make_llm(tiny_tokenized_dir, prefill_replicas=1, decode_replicas=1)
    pieces = list(llm.stream("a prompt", sp))
    assert len(pieces) > 1 and "".join(pieces) == want
    llm.core.assert_idle_and_clean()


def test_nothing_compiles_after_warmup(tiny_dir):
    """Pages moved from a one-device prefill replica to a two-device decode replica (a resharding copy) in every
    page-count bucket: all compiled at warm-up."""
    llm = make_llm(tiny_dir, prefill_replicas=1, decode_replicas=1, decode_tensor_parallel_size=2, warmup=True,
                   max_model_len=32, max_num_batched_tokens=8)
    buckets = llm.runner.page_buckets

    def serve(prompt):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    assert compiles_serving(serve, buckets) == []
    assert llm.stats().kv_transfers == len(buckets)
    llm.core.assert_idle_and_clean()


def test_nothing_compiles_after_warmup_on_separate_prefill_and_decode_servers(tiny_dir):
    """One device each, no mesh (a prefill server and a decode server): moving pages at warm-up must not leave
    either cache committed to its device, or every step compiles again once serving."""
    kw = dict(max_model_len=32, max_num_batched_tokens=8, warmup=True)
    prefill, decode = make_llm(tiny_dir, role="prefill", **kw), make_llm(tiny_dir, role="decode", **kw)
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)

    def serve(prompt):
        prefill.add_request({"prompt_token_ids": prompt}, sp)
        while not prefill.scheduler.handed_off:
            prefill.step()
        (h,) = prefill.core.take_handed_off()
        request = decode.make_request({"prompt_token_ids": prompt}, sp)
        kv = trimmed(h.kv, pages_needed(h.num_cached, prefill.scheduler.page_size))
        # What a decode server lets a fetch carry (fetch_pages' max_bytes): the prompt's pages exactly.
        assert kv_bytes(kv) == decode.runner.pages_bytes(len(prompt))
        decode.core.add_prefilled(request.seqs[0], kv, h.num_cached, first_token=h.seq.output_token_ids[0])
        while decode.has_unfinished_requests():
            decode.step()
    assert compiles_serving(serve, prefill.runner.page_buckets) == []
    with pytest.raises(ValueError, match="dtype float16 do not fit"):  # a cast would import other values
        request = decode.make_request({"prompt_token_ids": [1, 2, 3]}, sp)
        kv = jax.tree.map(lambda x: np.asarray(x, np.float16), decode.runner.export_pages([0]))
        decode.core.add_prefilled(request.seqs[0], kv, 3, first_token=1)
    prefill.core.assert_idle_and_clean()
    decode.core.assert_idle_and_clean()


def compiles_serving(serve, buckets) -> list[str]:
    """The programs compiled while serve(prompt) runs prompts filling every page-count bucket (pages of 4 tokens, up
    to 8 a sequence)."""
    compiles = []

    def on_compile(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))
    rng = np.random.default_rng()
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        for pages in buckets:
            serve(rng.integers(0, 320, min(4 * pages - 1, 28)).tolist())
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    return compiles


@pytest.mark.parametrize("args,error", [
    (dict(prefill_replicas=1), "go together"),
    (dict(decode_tensor_parallel_size=2), "needs prefill_replicas"),
    (dict(prefill_replicas=1, decode_replicas=1, data_parallel_size=2), "data_parallel_size"),
    (dict(prefill_replicas=1, decode_replicas=1, role="prefill"), "one or the other"),
    (dict(prefill_replicas=1, decode_replicas=1, speculative_config=dict(method="ngram", num_speculative_tokens=2)),
     "speculative decoding is not supported"),
    (dict(role="decode", enable_lora=True), "LoRA adapters are not supported"),
    (dict(role="other"), "role must be one of"),
    (dict(prefill_replicas=4, decode_replicas=1, tensor_parallel_size=2), "needs 10 devices; there are 8"),
])
def test_bad_config_is_refused(tiny_dir, args, error):
    with pytest.raises(ValueError, match=error):
        make_llm(tiny_dir, **args)


def test_metrics_show_the_transfers_and_pools():
    from jaxserve.openai.metrics import ServerMetrics
    llm = disaggregated_llm()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}] * 2, GREEDY, use_tqdm=False)
    metrics = ServerMetrics()
    metrics.add_model("m", llm.stats)
    text = metrics.exposition().decode()
    assert 'jaxserve:kv_transfer_bytes_count{model_name="m"} 2.0' in text
    assert 'jaxserve:kv_transfer_seconds_count{model_name="m"} 2.0' in text
    assert 'jaxserve:pool_num_requests_running{model_name="m",pool="decode"} 0.0' in text
    assert 'jaxserve:pool_num_requests_waiting{model_name="m",pool="prefill"} 0.0' in text
    assert 'jaxserve:decode_queue_time_seconds_count{model_name="m"} 2.0' in text


def test_a_prefilled_sequence_preempted_on_the_decode_side_is_recomputed_from_its_tokens():
    """Three sequences admitted with 3 pages each grow past the decode pool's 9: one is preempted, and recomputes
    its prompt and tokens there (the prefix cache off: every slot it reads, it wrote again)."""
    reqs = [({"prompt_token_ids": list(range(i, i + 9))}, SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True)) for i in range(3)]
    want = outputs(fake_llm(vocab_size=VOCAB), reqs)
    llm = disaggregated_llm(decode_args=dict(num_pages=10, enable_prefix_caching=False))
    assert outputs(llm, reqs) == want
    assert llm.stats().num_preemptions > 0
    llm.core.assert_idle_and_clean()


class Landing(np.ndarray):
    """Pages still being copied: not ready for the first few polls, or until waited for."""
    polls = 3

    def is_ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def block_until_ready(self):
        self.polls = -1
        return self


def test_a_sequence_is_admitted_to_decode_only_once_its_kv_has_landed():
    llm = disaggregated_llm()
    decode = llm.replicas[1]
    put = decode.runner.put_pages
    decode.runner.put_pages = lambda kv: [(k.view(Landing), v.view(Landing)) for k, v in put(kv)]
    imported = []
    import_pages = decode.runner.import_pages
    decode.runner.import_pages = lambda ids, kv: imported.append(kv[0][0].polls) or import_pages(ids, kv)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [9, 8]}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [list(range(6, 16)), list(range(9, 19))]
    assert len(imported) == 2 and all(polls < 0 for polls in imported)  # landed (polled or waited for) first
    llm.core.assert_idle_and_clean()


def test_a_failed_import_ends_only_its_own_request():
    decode = fake_llm(vocab_size=VOCAB)
    decode.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, request_id="innocent")
    decode.step()
    import_pages = decode.core.runner.import_pages

    def failing(page_ids, kv):
        if kv[0][0][0, 0] == 20:  # the bad request's pages
            raise RuntimeError("copy lost")
        import_pages(page_ids, kv)
    decode.core.runner.import_pages = failing
    for request_id, first in [("bad", 20), ("good", 30)]:
        request = decode.make_request({"prompt_token_ids": [first, first + 1]}, GREEDY, request_id=request_id)
        pages = np.array([[first, first + 1, -1, -1]])
        decode.core.add_prefilled(request.seqs[0], [(pages, pages)], 2, first_token=first + 2)
    tokens, failed = run_through_failures(decode)
    assert list(failed) == ["bad"] and "copy lost" in str(failed["bad"]) and decode.core.failed_steps == 0
    assert tokens["innocent"] == list(range(4, 14)) and tokens["good"] == list(range(33, 42))
    decode.core.assert_idle_and_clean()


def test_an_import_aborted_while_landing_is_dropped_and_never_counted():
    decode = fake_llm(vocab_size=VOCAB)
    decode.add_request({"prompt_token_ids": [9, 9]}, GREEDY)  # running: the engine polls the copy, never waits
    decode.step()
    put = decode.core.runner.put_pages
    decode.core.runner.put_pages = lambda kv: [(k.view(Landing), v.view(Landing)) for k, v in put(kv)]
    request = decode.make_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, request_id="r")
    pages = np.arange(4).reshape(1, 4)
    decode.core.add_prefilled(request.seqs[0], [(pages, pages)], 3, first_token=4)
    decode.step()  # still landing: not admitted
    assert request.seqs[0].status is Status.WAITING
    decode.abort_request("r")
    while decode.has_unfinished_requests():  # it lands meanwhile
        decode.step()
    assert decode.stats().kv_transfers == 0
    decode.core.assert_idle_and_clean()


def test_finishing_a_sequence_already_taken_from_the_hand_offs_is_harmless():
    prefill = disaggregated_llm().replicas[0]
    llm = LLM.over(EngineParts.over([prefill], VOCAB, 64))
    llm.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, request_id="r")
    while not prefill.scheduler.handed_off:
        llm.step()
    (hand_off,) = prefill.take_handed_off()
    prefill.scheduler.finish(hand_off.seq)
    assert hand_off.seq.status is Status.FINISHED
    prefill.assert_idle_and_clean()


def test_a_server_over_pools_streams_and_shows_them_in_metrics():
    import requests

    from serving import ServerThread, metric_samples, wait_idle

    want = fake_llm(vocab_size=VOCAB).generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    st = ServerThread(disaggregated_llm(1, 2), "pd")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        got = requests.post(st.url + "/v1/completions", json=body, timeout=60).json()
        stream = requests.post(st.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        chunks = [line for line in stream.text.splitlines() if line.startswith("data: {")]
        assert got["usage"]["completion_tokens"] == len(want[0].outputs[0].token_ids) == 10 and len(chunks) > 2
        wait_idle(st)  # the stats are taken after the step whose tokens ended the stream: not before the client saw it
        samples = metric_samples(requests.get(st.url + "/metrics", timeout=10).text)
        label = frozenset(['model_name="pd"'])
        assert samples["jaxserve:kv_transfer_bytes_count", label] == 2
        assert samples["jaxserve:num_replicas", label] == 3
        assert samples["jaxserve:pool_num_requests_running", label | {'pool="decode"'}] == 0
        assert requests.get(st.url + "/health", timeout=10).status_code == 200
    finally:
        st.stop()
