"""Constraints that leave nothing to sample, over HTTP (issue 48, item 7): a 400 naming the field where the request
alone shows it, otherwise finish_reason "error" (vLLM's) in the body and the stream, which the openai client reads
as it is; the server idle and clean after each."""
import json

import openai
import pytest

from serving import ServerThread, http, wait_idle
from tiny import make_llm

EOS = 319  # the tiny byte-level tokenizer's
B = 65  # its token for "b"


@pytest.fixture(scope="module")
def st(tiny_tokenized_dir):
    server = ServerThread(make_llm(tiny_tokenized_dir, max_model_len=64), "tiny")
    yield server
    server.stop()


def completion(st, **body):
    status, raw = http("POST", st.url + "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                             **body})
    wait_idle(st)
    return status, json.loads(raw) if not body.get("stream") else raw.decode()


@pytest.mark.parametrize("body, param", [
    (dict(allowed_token_ids=[EOS], min_tokens=4), "allowed_token_ids"),
    (dict(guided_choice=["a"], min_tokens=5), "min_tokens"),
    (dict(structured_outputs={"choice": ["yes", "no"]}, min_tokens=4), "min_tokens"),
    # The grammar's first token is none that allowed_token_ids allow: known once it is compiled (it ran, "error").
    (dict(guided_regex="a+", allowed_token_ids=[B]), "allowed_token_ids"),
])
def test_a_statically_empty_allowed_set_is_a_400(st, body, param):
    status, answer = completion(st, **body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def test_a_grammar_complete_before_min_tokens_finishes_with_error(st):
    """Only running shows it (the grammar's first token is possible): "a", then nothing but EOS, which min_tokens
    bans."""
    assert st.engine.llm.tokenizer.encode("b", add_special_tokens=False) == [B]
    body = dict(guided_regex="a", min_tokens=5, temperature=0)
    status, answer = completion(st, **body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "error" and answer["choices"][0]["text"] == "a"
    assert answer["usage"]["completion_tokens"] == 1
    status, stream = completion(st, stream=True, **body)
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "error"
    client = openai.OpenAI(base_url=st.url + "/v1", api_key="none")
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, extra_body=body)
    assert c.choices[0].finish_reason == "error" and c.choices[0].text == "a"
    wait_idle(st)
