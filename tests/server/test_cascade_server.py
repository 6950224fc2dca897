"""A cascade over the multi-model server (`jaxserve serve --model small --model large --cascade small,large`): each
policy sends a request to the tier its router file says, given the features the small model computes offline; the
answer names that tier and is the one asking that tier directly gives (an escalated one whole); internal logprobs
never reach the client; /metrics counts routes and escalations; /v1/models lists the cascade; the openai client
works against it; and the command line's errors. Two tiny random Llamas with a byte tokenizer (text and chat)."""
import json
from types import SimpleNamespace

import pytest

from jaxserve import SamplingParams
from jaxserve.cascade import CascadeRouter, TierClassifier, answer_features, prompt_features, score_params
from jaxserve.cascade.policy import CascadeConfig
from jaxserve.cli import main
from jaxserve.server.cascade import ServedCascade

from serving import ServerThread, http, metric_samples, token_counts, wait_idle
from tiny import make_llm

TIERS = ("small", "large")
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["The cat sat on", "Numbers: 1 2 3 4", "zq zq xv kk!", "hello world, hello", "{[()]} <> ;;", "ab ab ab ab"]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
LARGE_LEN = 128  # the large tier's max_model_len; the others' is 64
LONG = "A prompt of 83 tokens (one a byte): too long for the small tier, not for the large."


@pytest.fixture(scope="module")
def large_dir(other_tiny_dir, tmp_path_factory):
    """The other tiny random Llama with the same byte tokenizer: a second model of the same vocabulary."""
    from hf_models import with_byte_tokenizer
    return with_byte_tokenizer(other_tiny_dir, tmp_path_factory.mktemp("tiny-llama-other-tokenized"))


def split(features: dict[str, dict], name: str) -> tuple[float, set[str]]:
    """The midpoint between the two middle values of one feature over PROMPTS, and the prompts above it (half)."""
    values = sorted(f[name] for f in features.values())
    low, high = values[len(values) // 2 - 1], values[len(values) // 2]
    assert high - low > 1e-3, f"{name} does not split the prompts: {values}"  # else float noise could route
    mid = (low + high) / 2
    return mid, {p for p, f in features.items() if f[name] > mid}


@pytest.fixture(scope="module")
def served(tiny_dir, tiny_tokenized_dir, large_dir):
    """The server, and per prompt the small model's features computed offline (before any server drives it). The
    large tier takes longer requests than the others (LARGE_LEN). A third model, "mid", has the small one's weights:
    a middle tier that answers as the small one does; a fourth, "raw", the same ids with no tokenizer: another
    vocabulary as far as a cascade can tell."""
    llms = {"small": make_llm(tiny_tokenized_dir, max_model_len=64),
            "large": make_llm(large_dir, max_model_len=LARGE_LEN),
            "mid": make_llm(tiny_tokenized_dir, max_model_len=64), "raw": make_llm(tiny_dir, max_model_len=64)}
    small = llms["small"]
    for llm in llms.values():
        if llm.tokenizer is not None:
            llm.tokenizer.chat_template = TEMPLATE

    def ids(p):
        return {"prompt_token_ids": small.tokenizer.encode(p)}
    scores = {p: prompt_features(small.generate(ids(p), score_params(), use_tqdm=False)[0]) for p in PROMPTS}
    answers = {p: answer_features(small.generate(ids(p), SamplingParams(**GREEDY, logprobs=0),
                                                 use_tqdm=False)[0].outputs[0]) for p in PROMPTS}
    st = ServerThread(llms, cascade=CascadeConfig(TIERS, threshold=0.5))
    yield st, SimpleNamespace(scores=scores, answers=answers)
    st.stop()


def use(st, config: CascadeConfig) -> None:
    """The server's cascade from now on (same name: its metrics go on counting)."""
    st.server.cascade = ServedCascade(config, st.server.models, st.server.metrics)


def before_router(ref) -> tuple[CascadeRouter, set[str]]:
    """A before classifier keeping on the small tier the prompts of the upper half of prompt_mean_logprob."""
    mid, kept = split(ref.scores, "prompt_mean_logprob")
    classifier = TierClassifier(("prompt_mean_logprob",), (mid,), (1.0,), (1.0,), 0.0, 0.5)
    return CascadeRouter(TIERS, before=(classifier,)), kept


def after_router(ref) -> tuple[CascadeRouter, set[str]]:
    """An after classifier keeping the small tier's answers of the upper half of answer_mean_logprob. It reads a
    prompt feature too (weight 0), so the small tier is asked for its prompt's logprobs and top 20 as well."""
    mid, kept = split(ref.answers, "answer_mean_logprob")
    classifier = TierClassifier(("answer_mean_logprob", "first_margin"), (mid, 0.0), (1.0, 1.0), (1.0, 0.0), 0.0, 0.5)
    return CascadeRouter(TIERS, after=(classifier,)), kept


def post(st, body, path="/v1/completions") -> dict:
    status, content = http("POST", st.url + path, body)
    assert status == 200, content
    return json.loads(content)


def streamed(st, body, path="/v1/completions") -> list[dict]:
    status, content = http("POST", st.url + path, {**body, "stream": True})
    assert status == 200 and content.endswith(b"data: [DONE]\n\n"), content
    return [json.loads(line[6:]) for line in content.decode().splitlines() if line.startswith("data: {")]


def same_answer(routed: dict, direct: dict) -> None:
    """The routed response is the direct one: choices (text, finish, logprobs to float noise) and usage."""
    assert token_counts(routed["usage"]) == token_counts(direct["usage"])
    assert len(routed["choices"]) == len(direct["choices"])
    for r, d in zip(routed["choices"], direct["choices"]):
        assert {k: v for k, v in r.items() if k != "logprobs"} == {k: v for k, v in d.items() if k != "logprobs"}
        if d["logprobs"] is None:
            assert r["logprobs"] is None
        else:
            assert r["logprobs"]["tokens"] == d["logprobs"]["tokens"]
            assert r["logprobs"]["token_logprobs"] == pytest.approx(d["logprobs"]["token_logprobs"], abs=1e-4)
            assert [list(t) for t in r["logprobs"]["top_logprobs"]] == [list(t) for t in d["logprobs"]["top_logprobs"]]


def idle(st):
    for engine in st.engines.values():
        wait_idle(SimpleNamespace(server=st.server, engine=engine))


def tier_of(prompt: str, kept: set[str]) -> str:
    return "small" if prompt in kept else "large"


def scrape(st) -> dict:
    return metric_samples(http("GET", st.url + "/metrics")[1].decode())


def grew(seen: dict, now: dict, metric: str, **labels) -> float:
    key = (metric, frozenset(f'{k}="{v}"' for k, v in labels.items()))
    return now.get(key, 0) - seen.get(key, 0)


def cascade_series(samples: dict) -> dict:
    return {k: v for k, v in samples.items() if k[0].startswith("jaxserve:cascade_")}


def hook_requests(monkeypatch, st, tier: str, hook) -> None:
    """hook(request_id, stream) for each engine request the tier is asked (on the server's event loop); what it
    returns is the stream the server reads."""
    engine = st.engines[tier]
    add_request = engine.add_request

    async def hooked(prompt, params, request_id, **kw):
        return hook(request_id, await add_request(prompt, params, request_id, **kw))
    monkeypatch.setattr(engine, "add_request", hooked)


# ---- before: the small tier scores the prompt ----

def test_before_routes_each_prompt_by_its_score(served):
    st, ref = served
    router, kept = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router))
    assert st.server.cascade.config.policy == "before"
    for _ in range(2):  # deterministic: the same prompt, the same tier
        for p in PROMPTS:
            body = {"prompt": p, **GREEDY, "logprobs": 1}
            r = post(st, {**body, "model": "auto"})
            tier = tier_of(p, kept)
            assert r["model"] == tier, p
            same_answer(r, post(st, {**body, "model": tier}))
    # Streamed: the same tier, named in every chunk, the same text.
    for p in PROMPTS:
        chunks = streamed(st, {"model": "auto", "prompt": p, **GREEDY})
        assert {c["model"] for c in chunks} == {tier_of(p, kept)}
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert text == post(st, {"model": tier_of(p, kept), "prompt": p, **GREEDY})["choices"][0]["text"]
    idle(st)


def test_several_prompts_stay_only_if_each_is_kept(served):
    st, ref = served
    router, kept = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router))
    keep, move = sorted(kept), sorted(set(PROMPTS) - kept)
    assert post(st, {"model": "auto", "prompt": keep[:2], **GREEDY})["model"] == "small"
    mixed = post(st, {"model": "auto", "prompt": [keep[0], move[0]], **GREEDY, "n": 2})
    assert mixed["model"] == "large" and len(mixed["choices"]) == 4
    same_answer(mixed, post(st, {"model": "large", "prompt": [keep[0], move[0]], **GREEDY, "n": 2}))
    idle(st)


def test_the_threshold_moves_every_request(served):
    st, ref = served
    router, _ = before_router(ref)
    for threshold, tier in ((0.0, "small"), (1.0, "large")):
        use(st, CascadeConfig(TIERS, router=router, threshold=threshold))
        assert {post(st, {"model": "auto", "prompt": p, **GREEDY})["model"] for p in PROMPTS} == {tier}
    idle(st)


# ---- after: the small tier answers, and its answer is judged ----

def test_after_escalates_by_the_answer_and_returns_the_large_answer_whole(served):
    st, ref = served
    router, kept = after_router(ref)
    use(st, CascadeConfig(TIERS, router=router))
    assert st.server.cascade.config.policy == "after"
    for p in PROMPTS:
        tier = tier_of(p, kept)
        # No logprobs asked: none shown (the small tier was asked for 20 per token and its prompt's).
        r = post(st, {"model": "auto", "prompt": p, **GREEDY})
        assert r["model"] == tier, p
        assert r["choices"][0]["logprobs"] is None and "prompt_logprobs" not in r["choices"][0]
        same_answer(r, post(st, {"model": tier, "prompt": p, **GREEDY}))
        # Two top logprobs asked: exactly those, as the tier asked directly gives them; n = 2 alike.
        body = {"prompt": p, **GREEDY, "logprobs": 2, "n": 2}
        r = post(st, {**body, "model": "auto"})
        assert r["model"] == tier and all(len(t) <= 3 for t in r["choices"][0]["logprobs"]["top_logprobs"])
        same_answer(r, post(st, {**body, "model": tier}))
    idle(st)


def test_after_without_a_router_file_judges_the_per_token_probability(served):
    import math
    st, ref = served
    mid, kept = split(ref.answers, "answer_mean_logprob")
    use(st, CascadeConfig(TIERS, threshold=math.exp(mid)))
    for p in PROMPTS:
        assert post(st, {"model": "auto", "prompt": p, **GREEDY})["model"] == tier_of(p, kept), p
    idle(st)


def test_after_streams_are_routed_before_generating(served):
    """A stream under the after policy: by the before classifiers if the router has them, else to the last tier."""
    st, ref = served
    after, _ = after_router(ref)
    before, kept = before_router(ref)
    use(st, CascadeConfig(TIERS, router=after))
    seen = scrape(st)
    for p in PROMPTS[:2]:
        assert {c["model"] for c in streamed(st, {"model": "auto", "prompt": p, **GREEDY})} == {"large"}
    # Sent to the last tier unjudged: a route each, no escalation (the small tier was never asked).
    now = scrape(st)
    assert grew(seen, now, "jaxserve:cascade_requests_total", cascade="auto", tier="large") == 2
    assert grew(seen, now, "jaxserve:cascade_escalations_total", cascade="auto", from_tier="small",
                to_tier="large") == 0
    both = CascadeRouter(TIERS, before=before.before, after=after.after)
    use(st, CascadeConfig(TIERS, policy="after", router=both))
    for p in PROMPTS:
        assert {c["model"] for c in streamed(st, {"model": "auto", "prompt": p, **GREEDY})} == {tier_of(p, kept)}
    # Judged by the before classifiers: each one the small tier did not keep moved up.
    assert grew(now, scrape(st), "jaxserve:cascade_escalations_total", cascade="auto", from_tier="small",
                to_tier="large") == len(PROMPTS) - len(kept)
    idle(st)


def test_three_tiers_answer_from_the_middle(served):
    """small -> mid -> large under the after policy: small never keeps its answer, mid (the small model's weights)
    keeps the answers the split keeps; the answer is mid's whole (or large's), and each move up is counted."""
    st, ref = served
    three = ("small", "mid", "large")
    mid, kept = split(ref.answers, "answer_mean_logprob")
    never = TierClassifier(("answer_tokens_log",), (0.0,), (1.0,), (0.0,), -10.0, 0.5)
    judge = TierClassifier(("answer_mean_logprob",), (mid,), (1.0,), (1.0,), 0.0, 0.5)
    use(st, CascadeConfig(three, router=CascadeRouter(three, after=(never, judge))))
    seen = metric_samples(http("GET", st.url + "/metrics")[1].decode())
    for p in PROMPTS:
        tier = "mid" if p in kept else "large"
        body = {"prompt": p, **GREEDY, "logprobs": 1}
        r = post(st, {**body, "model": "auto"})
        assert r["model"] == tier, p
        same_answer(r, post(st, {**body, "model": tier}))
    now = metric_samples(http("GET", st.url + "/metrics")[1].decode())

    def grew(metric, **labels):
        key = (metric, frozenset(f'{k}="{v}"' for k, v in labels.items()))
        return now.get(key, 0) - seen.get(key, 0)
    assert grew("jaxserve:cascade_escalations_total", cascade="auto", from_tier="small", to_tier="mid") == len(PROMPTS)
    assert grew("jaxserve:cascade_escalations_total", cascade="auto", from_tier="mid",
                to_tier="large") == len(PROMPTS) - len(kept)
    assert grew("jaxserve:cascade_requests_total", cascade="auto", tier="mid") == len(kept)
    assert grew("jaxserve:cascade_requests_total", cascade="auto", tier="small") == 0
    idle(st)


# ---- a request's life: drains, refusals, tiers too short, clients that leave ----

def test_a_request_taken_before_a_drain_is_answered_through_every_stage(served, monkeypatch):
    """Graceful shutdown sets `draining` while a cascade request is in its scoring pass (before) or the small tier's
    answer (after): the request was taken, so its escalated answer comes (200), while a new one is refused (503)."""
    st, ref = served
    router, _ = before_router(ref)
    ask = {"model": "auto", "prompt": PROMPTS[0], **GREEDY}
    direct = post(st, {**ask, "model": "large"})

    def drain_now(request_id, stream):
        st.server.draining = True
        return stream
    hook_requests(monkeypatch, st, "small", drain_now)
    try:
        # threshold 1: every request moves up, so the large tier answers once the drain has begun.
        for config in (CascadeConfig(TIERS, router=router, threshold=1.0), CascadeConfig(TIERS, threshold=1.0)):
            use(st, config)
            r = post(st, ask)
            assert st.server.draining and r["model"] == "large", config
            same_answer(r, direct)
            for path, body in (("/v1/completions", ask), ("/v1/chat/completions",
                                                          {"model": "auto", "messages": [{"role": "user",
                                                                                          "content": "hi"}]})):
                status, content = http("POST", st.url + path, body)
                assert status == 503 and b"shutting down" in content, content
            st.server.draining = False
    finally:
        st.server.draining = False
    idle(st)


def test_a_route_counts_once_its_tier_takes_the_request(served, monkeypatch):
    """The large tier refuses (429: full): no route, escalation or routing time is counted, under either policy;
    once it takes requests again, each counts."""
    st, ref = served
    router, _ = before_router(ref)
    for config in (CascadeConfig(TIERS, router=router, threshold=1.0), CascadeConfig(TIERS, threshold=1.0)):
        use(st, config)
        seen = scrape(st)
        with monkeypatch.context() as m:
            m.setattr(st.server.models["large"], "capacity", 0)
            status, content = http("POST", st.url + "/v1/completions", {"model": "auto", "prompt": PROMPTS[1],
                                                                         **GREEDY})
            assert status == 429, content
        assert cascade_series(scrape(st)) == cascade_series(seen), config
        assert post(st, {"model": "auto", "prompt": PROMPTS[1], **GREEDY})["model"] == "large"
        now = scrape(st)
        assert grew(seen, now, "jaxserve:cascade_requests_total", cascade="auto", tier="large") == 1
        assert grew(seen, now, "jaxserve:cascade_escalations_total", cascade="auto", from_tier="small",
                    to_tier="large") == 1
        assert grew(seen, now, "jaxserve:cascade_routing_seconds_count", cascade="auto") == 1
    idle(st)


def test_a_tier_too_short_for_the_request_is_skipped(served):
    """A prompt + max_tokens past the small (and mid) tier's max_model_len but within the large one's: the large tier
    answers, as asked directly, under either policy and over three tiers, even with a threshold that keeps every
    request on the small tier; a route, no escalation. Too long for the last tier too: its 400, nothing counted."""
    st, ref = served
    body = {"prompt": LONG, **GREEDY, "logprobs": 1}
    direct = post(st, {**body, "model": "large"})
    assert direct["usage"]["prompt_tokens"] + GREEDY["max_tokens"] > 64
    before, _ = before_router(ref)
    after, _ = after_router(ref)
    three = ("small", "mid", "large")
    keep = TierClassifier(("first_margin",), (0.0,), (1.0,), (0.0,), 10.0, 0.5)  # p = sigmoid(10): keeps all
    for config in (CascadeConfig(TIERS, router=before, threshold=0.0), CascadeConfig(TIERS, router=after,
                                                                                     threshold=0.0),
                   CascadeConfig(TIERS, threshold=0.0),
                   CascadeConfig(three, router=CascadeRouter(three, before=(keep, keep)))):
        use(st, config)
        assert post(st, {"model": "auto", "prompt": PROMPTS[0], **GREEDY})["model"] == "small", config  # kept
        seen = scrape(st)
        r = post(st, {**body, "model": "auto"})
        assert r["model"] == "large", config
        same_answer(r, direct)
        chat = {"messages": [{"role": "user", "content": LONG}], **GREEDY}
        assert post(st, {**chat, "model": "auto"}, "/v1/chat/completions")["model"] == "large"
        now = scrape(st)
        assert grew(seen, now, "jaxserve:cascade_requests_total", cascade="auto", tier="large") == 2
        assert sum(v for k, v in cascade_series(now).items() if k[0] == "jaxserve:cascade_escalations_total") == \
            sum(v for k, v in cascade_series(seen).items() if k[0] == "jaxserve:cascade_escalations_total")
        status, content = http("POST", st.url + "/v1/completions", {**body, "model": "auto", "prompt": LONG * 2})
        assert status == 400 and f"maximum context length is {LARGE_LEN}" in json.loads(content)["error"]["message"]
        assert cascade_series(scrape(st)) == cascade_series(now)
    idle(st)


def test_a_scoring_pass_holds_one_sequence_a_prompt(served, monkeypatch):
    """Under the before policy the small tier scores each prompt once, whatever n: with room for one sequence on the
    small tier, a request for n = 3 is scored there and answered by the large tier."""
    st, ref = served
    router, _ = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router, threshold=1.0))
    body = {"prompt": PROMPTS[2], **GREEDY, "n": 3}
    with monkeypatch.context() as m:
        m.setattr(st.server.models["small"], "capacity", 1)
        r = post(st, {**body, "model": "auto"})
    assert r["model"] == "large" and len(r["choices"]) == 3
    same_answer(r, post(st, {**body, "model": "large"}))
    idle(st)


def test_a_client_that_leaves_during_the_scoring_pass_leaves_the_engines_idle(served, monkeypatch):
    """The client disconnects while the server awaits the small tier's scoring pass: the handler is cancelled, the
    pass aborted, the engines go idle, and nothing is counted: no route, no request finished on any tier."""
    import asyncio
    import contextlib
    import threading

    import aiohttp
    st, ref = served
    router, _ = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router, threshold=1.0))
    scoring = threading.Event()

    def slow_scores(request_id, stream):
        if "-score" not in request_id:
            return stream

        async def held():
            scoring.set()
            await asyncio.sleep(60)  # the client leaves meanwhile; the handler's cancellation ends this
            async for out in stream:
                yield out
        return held()
    hook_requests(monkeypatch, st, "small", slow_scores)

    async def leave_while_scoring():
        async with aiohttp.ClientSession() as s:
            async def send():
                return await s.post(st.url + "/v1/completions",
                                    json={"model": "auto", "prompt": [PROMPTS[3], PROMPTS[4]], **GREEDY})
            request = asyncio.create_task(send())
            assert await asyncio.to_thread(scoring.wait, 30), "no scoring pass began"
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
    seen = scrape(st)
    asyncio.run(leave_while_scoring())
    idle(st)  # within 30 s: the held pass would keep its admission for 60
    now = scrape(st)
    assert cascade_series(now) == cascade_series(seen)
    finished = {k: v for k, v in now.items() if k[0] == "jaxserve:request_success_total"}
    assert finished == {k: v for k, v in seen.items() if k[0] == "jaxserve:request_success_total"}


# ---- metrics, models, the openai client ----

def test_metrics_count_routes_and_escalations(served):
    st, ref = served

    def value(samples, metric, **labels):
        return samples.get((metric, frozenset(f'{k}="{v}"' for k, v in labels.items())), 0)
    for router, kept in (before_router(ref), after_router(ref)):
        use(st, CascadeConfig(TIERS, router=router))
        seen = metric_samples(http("GET", st.url + "/metrics")[1].decode())
        for p in PROMPTS:
            post(st, {"model": "auto", "prompt": p, **GREEDY})
        post(st, {"model": "large", "prompt": PROMPTS[0], **GREEDY})  # named directly: not the cascade's
        now = metric_samples(http("GET", st.url + "/metrics")[1].decode())

        def grew(metric, **labels):
            return value(now, metric, **labels) - value(seen, metric, **labels)
        small, large = len(kept), len(PROMPTS) - len(kept)
        assert grew("jaxserve:cascade_requests_total", cascade="auto", tier="small") == small
        assert grew("jaxserve:cascade_requests_total", cascade="auto", tier="large") == large
        assert grew("jaxserve:cascade_escalations_total", cascade="auto", from_tier="small", to_tier="large") == large
        assert grew("jaxserve:cascade_routing_seconds_count", cascade="auto") == len(PROMPTS)
        assert grew("jaxserve:cascade_routing_seconds_sum", cascade="auto") > 0
        # The tiers' own series count the answers they gave (after: the small tier's dropped ones too).
        answered_small = len(PROMPTS) if router.after is not None else small
        assert grew("jaxserve:request_success_total", model_name="small", finished_reason="length") == answered_small
        assert grew("jaxserve:request_success_total", model_name="large", finished_reason="length") == large + 1
    idle(st)


def test_models_lists_the_cascade_and_its_tokenizer_is_its_tiers(served):
    st, ref = served
    router, kept = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router))
    data = json.loads(http("GET", st.url + "/v1/models")[1])["data"]
    # The cascade takes what its last tier takes (a cheaper tier too short for a request is skipped).
    assert [(m["id"], m["max_model_len"]) for m in data] == [("small", 64), ("large", LARGE_LEN), ("mid", 64),
                                                             ("raw", 64), ("auto", LARGE_LEN)]
    assert (data[4]["root"], data[4]["parent"], data[4]["object"]) == ("small,large", None, "model")
    tokens = post(st, {"model": "auto", "prompt": "hello"}, "/tokenize")
    assert tokens == post(st, {"model": "small", "prompt": "hello"}, "/tokenize")
    # Token ids mean the same to both tiers (one vocabulary): a cascade takes them, routes them as the same text and
    # gives the same answer.
    for p in PROMPTS:
        ids = post(st, {"model": "auto", "prompt": p}, "/tokenize")["tokens"]
        as_ids, as_text = (post(st, {"model": "auto", "prompt": prompt, **GREEDY, "logprobs": 1})
                           for prompt in (ids, p))
        assert as_ids["model"] == as_text["model"] == tier_of(p, kept), p
        same_answer(as_ids, as_text)
    status, content = http("POST", st.url + "/v1/completions", {"model": "auto2", "prompt": "x"})
    assert status == 404 and "`auto`" in json.loads(content)["error"]["message"]
    idle(st)


def test_tiers_of_different_vocabularies_take_text_only(served):
    """A cascade over the small model and "raw" (the same ids, no tokenizer): token ids could mean different
    tokens to its tiers, so a prompt of them and /tokenize under the cascade's name are 400s naming the fix."""
    st, _ = served
    use(st, CascadeConfig(("small", "raw"), threshold=0.5))
    try:
        assert not st.server.cascade.shared_vocabulary
        for body, path, field in (({"prompt": [5, 6, 7], **GREEDY}, "/v1/completions", "prompt"),
                                  ({"prompt": ["text", [5, 6]], **GREEDY}, "/v1/completions", "prompt"),
                                  ({"prompt": "hello"}, "/tokenize", "model")):
            status, content = http("POST", st.url + path, {"model": "auto", **body})
            error = json.loads(content)["error"]
            assert (status, error["param"], error["type"]) == (400, field, "invalid_request_error"), content
            assert "small, raw" in error["message"] and "name one" in error["message"], error
    finally:
        use(st, CascadeConfig(TIERS, threshold=0.5))
    idle(st)


def test_the_apis_built_on_chat_refuse_the_cascade(served):
    """Anthropic's Messages and OpenAI's Responses run one model's chat path: the cascade's name is a 400 there, in
    each API's error shape, naming the route."""
    st, _ = served
    status, content = http("POST", st.url + "/v1/messages", {"model": "auto", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 400 and "not /v1/messages" in json.loads(content)["error"]["message"], content
    status, content = http("POST", st.url + "/v1/responses", {"model": "auto", "input": "hi"})
    error = json.loads(content)["error"]
    assert (status, error["param"]) == (400, "model") and "not /v1/responses" in error["message"], content
    idle(st)


def test_after_refuses_max_tokens_0(served):
    st, ref = served
    use(st, CascadeConfig(TIERS, router=after_router(ref)[0]))
    seen = scrape(st)
    # (echo: a request that only scores its prompt, valid when naming a model)
    status, content = http("POST", st.url + "/v1/completions", {"model": "auto", "prompt": "hi", "max_tokens": 0,
                                                                 "echo": True})
    error = json.loads(content)["error"]
    assert (status, error["param"]) == (400, "max_tokens") and "none to judge" in error["message"], content
    assert cascade_series(scrape(st)) == cascade_series(seen)
    idle(st)


def test_openai_client_against_the_cascade(served):
    from openai import OpenAI
    st, ref = served
    router, kept = before_router(ref)
    use(st, CascadeConfig(TIERS, router=router))
    c = OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
    assert "auto" in [m.id for m in c.models.list().data]
    for p in PROMPTS[:3]:
        r = c.completions.create(model="auto", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        direct = c.completions.create(model=tier_of(p, kept), prompt=p, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.model == tier_of(p, kept) and r.choices[0].text == direct.choices[0].text
        assert token_counts(r.usage) == token_counts(direct.usage)
        chunks = list(c.completions.create(model="auto", prompt=p, max_tokens=6, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert {ch.model for ch in chunks} == {r.model}
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # Chat: the template renders the conversation per tier; both policies, each way.
    ask = [{"role": "user", "content": "Say something."}]
    for config, tier in ((CascadeConfig(TIERS, router=router, threshold=1.0), "large"),
                         (CascadeConfig(TIERS, router=router, threshold=0.0), "small"),
                         (CascadeConfig(TIERS, router=after_router(ref)[0], threshold=0.0), "small"),
                         (CascadeConfig(TIERS, router=after_router(ref)[0], threshold=1.0), "large")):
        use(st, config)
        r = c.chat.completions.create(model="auto", messages=ask, max_tokens=5, temperature=0, logprobs=True,
                                      top_logprobs=1)
        assert r.model == tier, config
        direct = c.chat.completions.create(model=r.model, messages=ask, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=1)
        assert r.choices[0].message.content == direct.choices[0].message.content
        assert [len(t.top_logprobs) for t in r.choices[0].logprobs.content] == [1] * len(
            direct.choices[0].logprobs.content)
        chunks = list(c.chat.completions.create(model="auto", messages=ask, max_tokens=5, temperature=0, stream=True))
        # after: a stream goes by the before classifiers, which this router has none of: to the last tier
        assert {ch.model for ch in chunks} == {tier if config.policy == "before" else "large"}
    idle(st)


# ---- the command line ----

def write_router(tmp_path, tiers=TIERS, **policies) -> str:
    c = TierClassifier(("first_margin",), (0.0,), (1.0,), (1.0,), 0.0, 0.5)
    path = tmp_path / "router.json"
    CascadeRouter(tiers, **{p: (c,) * (len(tiers) - 1) for p in policies or ("before",)}).save(path)
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--cascade", "a,c", "--cascade-threshold", "0.5"], "'c' is not a served model"),
    (["--cascade", "a", "--cascade-threshold", "0.5"], "at least 2 tiers"),
    (["--cascade", "a,a", "--cascade-threshold", "0.5"], "more than once"),
    (["--cascade", "a,b"], "give --cascade-threshold"),
    (["--cascade", "a,b", "--cascade-threshold", "1.5"], "--cascade-threshold must be a probability"),
    (["--cascade", "a,b", "--cascade-policy", "before", "--cascade-threshold", "0.5"], "give --router-file"),
    (["--cascade", "a,b", "--cascade-name", "a", "--cascade-threshold", "0.5"], "already a served model"),
    (["--cascade-threshold", "0.5"], "--cascade-threshold configure a cascade"),
    (["--router-file", "r.json", "--cascade-name", "x"], "--cascade-name, --router-file configure a cascade"),
    (["--cascade", "a,b", "--router-file", "{missing}"], "cannot be read"),
    (["--cascade", "a,b", "--router-file", "{corrupt}"], "version"),
    (["--cascade", "a,b", "--router-file", "{other_tiers}"], "the router file is for the tiers b,a"),
    (["--cascade", "a,b", "--router-file", "{before_only}", "--cascade-policy", "after"], "no 'after' classifiers"),
])
def test_cascade_flag_errors_are_one_line_before_anything_loads(argv, message, tmp_path, capsys):
    files = {"missing": str(tmp_path / "none.json"), "other_tiers": write_router(tmp_path, ("b", "a"))}
    (tmp_path / "sub").mkdir()
    files["before_only"] = write_router(tmp_path / "sub", ("a", "b"))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(json.dumps({**json.loads(open(files["before_only"]).read()), "version": 9}))
    files["corrupt"] = str(corrupt)
    argv = [a.format(**files) for a in argv]
    assert main(["serve", "--model", "a", "--model", "b", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_serve_builds_the_cascade(tiny_tokenized_dir, large_dir, tmp_path, monkeypatch):
    """cmd_serve with --cascade: a server whose cascade routes over the named tiers by the router file's policy."""
    import jaxserve.server
    seen = {}

    async def fake_serve(server, host, port, grace_period_s=30.0, ready=None):
        seen["cascade"] = server.cascade
        for engine in server.engines():
            engine.shutdown(30)
    monkeypatch.setattr(jaxserve.server, "serve", fake_serve)
    path = write_router(tmp_path, TIERS, before=True, after=True)
    assert main(["serve", "--model", tiny_tokenized_dir, "--model", large_dir, "--served-model-name", "small",
                 "--served-model-name", "large", "--cascade", "small, large", "--cascade-name", "cheapest",
                 "--router-file", path, "--cascade-policy", "after", "--cascade-threshold", "0.25",
                 "--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--block-size",
                 "4", "--no-warmup"]) == 0
    cascade = seen["cascade"]
    assert (cascade.name, cascade.names, cascade.config.policy) == ("cheapest", TIERS, "after")
    assert [c.threshold for c in cascade.judges] == [0.25] and cascade.stream_judges[0].threshold == 0.25
    assert [m.name for m in cascade.tiers] == list(TIERS)
