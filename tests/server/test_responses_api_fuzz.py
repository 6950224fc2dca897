"""Fuzzing /v1/responses (issue 52) as the other rich endpoints are (tests/server/test_fuzz_endpoints.py): whatever
the body (input items, tools, tool_choice, text.format, previous_response_id, sampling fields, stream or not), the
answer is below 500 (an OpenAI-style error for a 4xx, never a traceback), the server stays alive and every KV page
comes back. Hypothesis draws the bodies from a fixed seed (derandomized); a failure's message prints the body.

The tiny random Llama with a byte tokenizer behind a Hermes-style template: grammars compile in milliseconds."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import ServerThread, http, wait_idle
from tiny import make_llm

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
KEYS = ["type", "role", "content", "text", "name", "arguments", "call_id", "output", "properties", "items",
        "required", "format", "schema", "id", "status", "input_text", "output_text", "function"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=10), st.sampled_from(["message", "function_call", "function_call_output",
                                                           "reasoning", "input_text", "output_text", "user",
                                                           "assistant", "system", "developer", "tool", "\ud800"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=5)), inner,
                                                 max_size=5)), max_leaves=20)
texts = st.one_of(st.text(max_size=20), st.sampled_from(["", "\x00", "\ud800", "[" * 3000, "<tool_call>"]))


def mostly(draw, plausible):
    """A plausible value four times in five, else any JSON value: most bodies get past the first check."""
    return draw(json_values) if draw(st.integers(0, 4)) == 0 else draw(plausible)


@st.composite
def items(draw):
    kind = draw(st.sampled_from(["message", "message", "parts", "call", "output", "reasoning", "junk"]))
    role = mostly(draw, st.sampled_from(["user", "system", "developer", "assistant", "tool"]))
    if kind == "message":
        return {"role": role, "content": mostly(draw, st.text(min_size=1, max_size=20))}
    if kind == "parts":
        part = mostly(draw, st.builds(lambda t, x: {"type": t, "text": x},
                                      st.sampled_from(["input_text", "output_text", "input_image"]), texts))
        return {"type": "message", "role": role, "content": [part]}
    if kind == "call":
        return {"type": "function_call", "call_id": draw(texts), "name": draw(st.sampled_from(["f", "g", ""])),
                "arguments": mostly(draw, st.one_of(st.just('{"a": 1}'), texts))}
    if kind == "output":
        return {"type": "function_call_output", "call_id": draw(texts), "output": mostly(draw, texts)}
    if kind == "reasoning":
        return {"type": "reasoning", "id": "rs_1", "summary": [], "content": draw(json_values)}
    return draw(json_values)


@st.composite
def bodies(draw):
    schema = mostly(draw, st.just({"type": "object", "properties": {"a": {"type": "integer"}}}))
    tool = draw(st.sampled_from([{"type": "function", "name": "f", "parameters": schema},
                                 {"type": "function", "name": draw(texts), "parameters": schema},
                                 {"type": "web_search"}, draw(json_values)]))
    optional = {
        "instructions": texts,
        "tools": st.sampled_from([[tool], [tool, tool], schema]),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                                        {"type": "function", "name": "g"}]),
        "text": st.sampled_from([{"format": {"type": "json_schema", "name": "x", "schema": schema}},
                                 {"format": {"type": "json_object"}}, {"format": schema}]),
        "max_output_tokens": st.one_of(st.integers(-2, 6), st.integers(-2**40, 2**40)),
        "previous_response_id": texts,
        "temperature": st.floats(0, 3), "top_p": st.floats(0, 1), "seed": st.integers(-2**70, 2**70),
        "stream": st.booleans(), "store": st.booleans(), "include": st.just([]),
        "reasoning": st.just({"effort": None}), "metadata": st.just({"k": "v"}), "background": st.booleans(),
        "truncation": st.sampled_from(["disabled", "auto"]), draw(st.text(max_size=8)): json_values,
    }
    body = {"model": "tiny", "input": mostly(draw, st.one_of(st.text(min_size=1, max_size=20), texts,
                                                           st.lists(items(), min_size=1, max_size=3))),
            "max_output_tokens": 4}
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=5, unique=True)):
        body[key] = mostly(draw, optional[key])
    return body


TEMPLATE = "{# <tool_call> #}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tiny_tokenized_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("responses-fuzz") / "chat.jinja"
    template.write_text(TEMPLATE)
    st_ = ServerThread(make_llm(tiny_tokenized_dir, max_model_len=256, chat_template=str(template)), "tiny")
    yield st_
    st_.stop()


@FUZZ
@given(body=bodies())
def test_responses_bodies_never_answer_5xx(server, body):
    status, raw = http("POST", server.url + "/v1/responses", body)
    shown = json.dumps(body)[:2000]
    assert status < 500, f"{status} for {shown}: {raw[:500]!r}"
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] and "Traceback" not in error["message"], (shown, error)
    elif body.get("stream") is True:  # an error after the status line is an error event, never a server error
        assert b"internal server error" not in raw and b"generation failed" not in raw, (shown, raw[-500:])
    else:
        answer = json.loads(raw)
        assert answer["status"] in ("completed", "incomplete") and answer["usage"]["total_tokens"] > 0, shown
    assert http("GET", server.url + "/health")[0] == 200
    wait_idle(server)
