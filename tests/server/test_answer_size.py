"""Large answers (issue 48, item 8): echo and prompt_logprobs make an answer grow with its prompt, so (a) a request
whose answer could hold more logprob entries than the server gives one request, or more top logprobs a position than
--max-logprobs, is a 400 before any work, and (b) an answer with logprobs is built and encoded off the event loop:
/health is answered while it is (a gate inside the encoder holds it there, no clocks)."""
import contextlib
import json
import random
import threading
import urllib.request

import pytest

from jaxserve.openai.answer_size import LogprobLimits, encode_json, logprob_entries
from jaxserve.openai.errors import ApiError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import responses

from serving import ServerThread, http, wait_idle
from tiny import make_llm

MAX_ENTRIES = 2000


@pytest.fixture(scope="module")
def st(tiny_dir):
    server = ServerThread(make_llm(tiny_dir), "tiny", max_logprobs=5, max_logprob_entries=MAX_ENTRIES)
    yield server
    server.stop()


def health(st) -> tuple[int, dict]:
    """GET /health; a timeout (the event loop never answered) fails the test rather than hanging it."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(st.url + "/health", timeout=30) as r:
        return r.status, json.loads(r.read())


@contextlib.contextmanager
def gated_encoder(monkeypatch):
    """The server's encode_json held at a gate: (entered, gate, the names of the threads it ran on)."""
    entered, gate, threads = threading.Event(), threading.Event(), []
    real = responses.encode_json

    def gated(obj):
        threads.append(threading.current_thread().name)
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return real(obj)
    monkeypatch.setattr(responses, "encode_json", gated)
    try:
        yield entered, gate, threads
    finally:
        gate.set()


def in_background(fn):
    """fn() on a thread: (thread, its result once joined, in a dict)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    return thread, result


def without_ids(raw: bytes) -> list:
    """An answer (or its stream's events) less what differs between identical requests (id, created)."""
    text = raw.decode()
    bodies = ([json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
              if text.startswith("data: ") else [json.loads(text)])
    return [{k: v for k, v in b.items() if k not in ("id", "created")} for b in bodies]


@pytest.mark.parametrize("stream", [False, True])
def test_health_is_answered_while_a_large_answer_is_encoded(st, monkeypatch, stream):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")  # shown when the test fails
    rng = random.Random(seed)
    body = {"prompt": [rng.randrange(1, 320) for _ in range(rng.randint(8, 30))], "max_tokens": 3, "echo": True,
            "logprobs": 5, "prompt_logprobs": 5, "temperature": 0, "stream": stream}
    url = st.url + "/v1/completions"
    with gated_encoder(monkeypatch) as (entered, gate, threads):
        thread, result = in_background(lambda: http("POST", url, body))
        assert entered.wait(60), "the answer was never encoded"
        assert health(st) == (200, {"status": "ok"})  # the event loop is free while the encoder is held
        gate.set()
        thread.join(60)
    # On the model's own responding threads: neither the loop nor the tokenizing threads.
    assert threads and all(name.startswith("respond-tiny") for name in threads), threads
    status, raw = result["value"]
    assert status == 200, raw
    assert without_ids(raw) == without_ids(http("POST", url, body)[1])  # what the same request gets ungated
    choice = without_ids(raw)[0]["choices"][0]
    assert choice["logprobs"]["tokens"][:len(body["prompt"])] == [str(t) for t in body["prompt"]]
    assert len(choice["prompt_logprobs"]) == len(body["prompt"])
    wait_idle(st)


def test_a_tokenize_answer_is_encoded_off_the_event_loop(tiny_tokenized_dir, monkeypatch):
    rng = random.Random(random.randrange(1 << 30))
    text = "".join(chr(rng.randrange(32, 127)) for _ in range(5000))
    st = ServerThread(make_llm(tiny_tokenized_dir), "tok")
    try:
        with gated_encoder(monkeypatch) as (entered, gate, threads):
            body = {"prompt": text, "return_token_strs": True}
            thread, result = in_background(lambda: http("POST", st.url + "/tokenize", body))
            assert entered.wait(60), "the answer was never encoded"
            assert health(st) == (200, {"status": "ok"})
            gate.set()
            thread.join(60)
        assert threads and all(name.startswith("tokenize-tok") for name in threads), threads
        status, raw = result["value"]
        reply = json.loads(raw)
        assert status == 200 and reply["count"] == len(reply["tokens"]) == len(reply["token_strs"]) > 0
        assert st.engine.llm.tokenizer.decode(reply["tokens"]) == text
    finally:
        st.stop()


def test_answers_past_the_limits_are_refused_before_any_work(st, monkeypatch):
    def submitted(*args, **kwargs):
        raise AssertionError("a request past the limits reached the engine")
    monkeypatch.setattr(st.engine, "add_request", submitted)
    for body, param, words in [
        ({"prompt": [1, 2], "prompt_logprobs": 6}, "prompt_logprobs", "at most 5 (--max-logprobs)"),
        # 4 prompts x ((8 + 40) x 6 with echo + 40 x 6 prompt_logprobs) = 2,112 entries
        ({"prompt": [[7] * 40] * 4, "max_tokens": 8, "echo": True, "logprobs": 5, "prompt_logprobs": 5},
         "prompt_logprobs", "2,112 logprob entries"),
        # n repeats each choice's: 4 x 90 x 6 = 2,160
        ({"prompt": [3, 4], "max_tokens": 90, "n": 4, "logprobs": 5}, "logprobs", "2,160 logprob entries"),
    ]:
        status, raw = http("POST", st.url + "/v1/completions", body)
        error = json.loads(raw)["error"]
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), raw
        assert words in error["message"], error["message"]
    wait_idle(st)


def test_logprob_entries_count_what_the_answer_shows():
    params = SamplingParams(n=2, max_tokens=3, logprobs=4, prompt_logprobs=5)
    # per prompt: n x ((3 generated + 10 echoed) x 5) + n x 10 x (2 + 1) in completions, once in chat
    assert logprob_entries([10], params, chat=False, echo=True, shown_prompt_logprobs=2,
                           max_model_len=64) == 2 * 13 * 5 + 2 * 10 * 3
    assert logprob_entries([10], params, chat=True, echo=False, shown_prompt_logprobs=2,
                           max_model_len=64) == 2 * 3 * 5 + 10 * 3
    # max_tokens None: up to max_model_len; no logprobs asked: nothing
    assert logprob_entries([10, 20], SamplingParams(max_tokens=None, logprobs=0), chat=True, echo=False,
                           shown_prompt_logprobs=None, max_model_len=64) == 54 + 44
    assert logprob_entries([10], SamplingParams(), chat=False, echo=True, shown_prompt_logprobs=None,
                           max_model_len=64) == 0


def test_chat_top_logprobs_past_max_logprobs_names_its_field():
    with pytest.raises(ApiError, match="top_logprobs 4 .* at most 3") as e:
        LogprobLimits(max_logprobs=3).check_counts(SamplingParams(logprobs=4), chat=True)
    assert (e.value.status, e.value.param) == (400, "top_logprobs")
    LogprobLimits(max_logprobs=3).check_counts(SamplingParams(logprobs=3, prompt_logprobs=3), chat=True)


@pytest.mark.parametrize("limits", [{"max_logprobs": 21}, {"max_logprobs": -1}, {"max_entries": 0}])
def test_limits_the_server_cannot_keep_are_refused(limits):
    with pytest.raises(ValueError, match="max_logprob"):  # 21: more than the device computes
        LogprobLimits(**limits)


def test_encode_json_writes_what_json_dumps_writes():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)

    def value(depth):
        kind = rng.randrange(8 if depth < 5 else 5)
        if kind == 0:
            return rng.random() * rng.choice([1, -1e300, 1e-300, float("nan"), float("inf")])
        if kind == 1:
            return rng.randrange(-10**20, 10**20)
        if kind == 2:
            return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF), 0x1F600, 0x22, 0x5C]))
                           for _ in range(rng.randrange(6)))
        if kind == 3:
            return rng.choice([None, True, False])
        if kind == 4:
            return []
        if kind == 5:  # long lists are encoded in slices
            return [value(depth + 1) for _ in range(rng.choice([1, 3, 64, 65, 200]))]
        keys = [rng.choice(["a", "\u00e9", "k\"", str(rng.randrange(99))]) for _ in range(rng.randrange(5))]
        return {k: value(depth + 1) for k in keys}
    for _ in range(30):
        obj = {"choices": [value(1) for _ in range(rng.randrange(4))], "x": value(0)}
        assert encode_json(obj) == json.dumps(obj).encode(), f"seed {seed}"
    # Keys json writes from other types
    keyed = {1: [{"a": 1}] * 70, None: [4] * 70, False: 2.5, 2.5: "x"}
    assert encode_json(keyed) == json.dumps(keyed).encode()
