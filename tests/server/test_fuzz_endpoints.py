"""Fuzzing the endpoints that take rich input (issue 48): structured output, tools and LoRA loading (P/D transfer
parameters are fuzzed against role servers in tests/router/test_pd_server.py). Whatever the body, the server answers
below 500, stays alive and leaks nothing: a hostile body is a 4xx, never a crash or a traceback. Hypothesis draws the
bodies from a fixed seed (derandomized), so a failure reproduces; its message prints the body.

The tiny random Llama with a byte tokenizer: grammars compile against its 320-token vocabulary in milliseconds."""
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.server.served_model import AutoTools
from jaxserve.structured_output.grammar import MAX_SPEC_CHARS

import deep_specs
from serving import ServerThread, http, wait_idle
from tiny import make_llm

EXAMPLES = 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# JSON values, with the keys a schema or a tool uses so that the fuzz reaches past the first type check.
SCHEMA_KEYS = ["type", "properties", "items", "required", "enum", "const", "$ref", "$defs", "anyOf", "oneOf",
               "allOf", "pattern", "minLength", "maxLength", "minimum", "maximum", "additionalProperties",
               "format", "minItems", "maxItems", "prefixItems", "not", "definitions"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "nonsense"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(TYPES + ["#/$defs/a", "#", "(", "(a*)*b", "[", "\\"]))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(SCHEMA_KEYS), st.text(max_size=6)), inner,
                                            max_size=5)),
    max_leaves=25)

@st.composite
def schemas(draw, depth=3):
    """A plausible JSON schema (so that most bodies get past validation and reach the compiler), now and then with
    a fuzzed value in any place."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(st.fixed_dictionaries({"type": st.sampled_from(TYPES)}), json_values))
    kind = draw(st.sampled_from(["object", "array", "anyOf", "ref", "enum", "string"]))
    if kind == "object":
        props = draw(st.dictionaries(st.text(max_size=5), schemas(depth - 1), max_size=3))
        return {"type": "object", "properties": props,
                "required": draw(st.lists(st.sampled_from(sorted(props) or ["x"]), max_size=2))}
    if kind == "array":
        return {"type": "array", "items": draw(schemas(depth - 1)), "minItems": draw(st.integers(-1, 3))}
    if kind == "anyOf":
        return {"anyOf": draw(st.lists(schemas(depth - 1), max_size=3))}
    if kind == "ref":
        return {"$defs": {"a": draw(schemas(depth - 1))}, "$ref": draw(st.sampled_from(["#/$defs/a", "#/$defs/b",
                                                                                      "#", "http://x/y"]))}
    if kind == "enum":
        return {"enum": draw(st.lists(json_values, max_size=3))}
    return {"type": "string", "pattern": draw(nasty_texts), "maxLength": draw(st.integers(-1, 10**6))}


# Texts that have broken parsers before: deep nesting, bad regexes, grammars that recurse.


def deep(makers):
    """A chain of any depth, or as deep as fits in the size cap (where llguidance 1.9.1 crashed the process)."""
    at_cap = st.sampled_from(makers).map(lambda make: make(deep_specs.largest(make, MAX_SPEC_CHARS)))
    return st.one_of(at_cap, st.builds(lambda make, n: make(n), st.sampled_from(makers), st.integers(1, 3000)))


deep_schemas, deep_grammars = deep(deep_specs.SCHEMAS), deep(deep_specs.GRAMMARS)
nasty_texts = st.one_of(deep_grammars, deep_schemas.map(json.dumps), st.text(max_size=40), st.sampled_from([
    "[" * 5000 + "]" * 5000, "{" * 3000, "(", "(a*)*b", "a{99999}", "[z-a]", "\\", "start: start", "start: x\nx: x",
    "root ::= root", 'start: "a"', "%import common.WS", "(.|.)*Z", "\x00", "\u2028"]))


def structured(value, text):
    """One of the ways a request asks for structured output, holding the fuzzed value or text."""
    return st.sampled_from([
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}},
        {"response_format": {"type": "json_schema", "json_schema": value}},
        {"response_format": value},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": value}},
        {"structured_outputs": {"json": text}},
        {"structured_outputs": {"regex": text}},
        {"structured_outputs": {"choice": value}},
        {"structured_outputs": {"grammar": text}},
        {"structured_outputs": value},
        {"guided_json": value},
        {"guided_regex": text},
        {"guided_choice": value},
        {"guided_grammar": text},
    ])


@st.composite
def structured_bodies(draw):
    value, text = draw(st.one_of(schemas(), deep_schemas, json_values)), draw(nasty_texts)
    return {"model": "tiny", "max_tokens": 3, **draw(structured(value, text)),
            **draw(st.sampled_from([{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"}]))}


@st.composite
def tool_bodies(draw):
    params = draw(st.one_of(schemas(), deep_schemas, json_values))
    tool = draw(st.sampled_from([
        {"type": "function", "function": {"name": "f", "parameters": params}},
        {"type": "function", "function": {"name": draw(st.text(max_size=8)), "parameters": params}},
        {"type": "function", "function": params},
        draw(json_values)]))
    choice = draw(st.one_of(st.sampled_from(["auto", "none", "required", {"type": "function", "function": {
        "name": "f"}}]), json_values))
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "tools": draw(st.sampled_from([[tool], [tool, tool], params])), "tool_choice": choice}


# Hermes tool calls (the tag spelled out), and nothing of the tools rendered: the byte tokenizer's prompts stay short.
TEMPLATE = "{# <tool_call> #}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tiny_tokenized_dir, tmp_path_factory):
    """The tiny model with a Hermes tool-calling chat template, adapters and runtime loading."""
    template = tmp_path_factory.mktemp("fuzz-template") / "chat.jinja"
    template.write_text(TEMPLATE)
    st_ = ServerThread(make_llm(tiny_tokenized_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
                                chat_template=str(template)), "tiny", allow_runtime_lora_updating=True,
                      auto_tools=AutoTools(enabled=True))
    yield st_
    st_.stop()


def answered(url, path, body):
    status, raw = http("POST", url + path, body)
    assert status < 500, f"{status} for {json.dumps(body)[:2000]}: {raw[:500]!r}"
    if status >= 400:  # an OpenAI-style error, never a traceback
        error = json.loads(raw)["error"]
        assert error["message"] and "Traceback" not in error["message"], error
    return status


def alive_and_clean(st_):
    status, _ = http("GET", st_.url + "/health")
    assert status == 200
    wait_idle(st_)


@FUZZ
@given(body=structured_bodies())
def test_structured_output_bodies_never_answer_5xx(server, body):
    answered(server.url, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    alive_and_clean(server)


@FUZZ
@given(body=tool_bodies())
def test_tool_bodies_never_answer_5xx(server, body):
    answered(server.url, "/v1/chat/completions", body)
    alive_and_clean(server)


@FUZZ
@given(kwargs=st.one_of(json_values, st.dictionaries(st.one_of(st.sampled_from(
    ["enable_thinking", "messages", "tools", "add_generation_prompt", "bos_token", "x"]), st.text(max_size=6)),
    json_values, max_size=4)))
def test_chat_template_kwargs_never_answer_5xx(server, kwargs):
    """vLLM's chat_template_kwargs: any JSON is a 200 or a 400, whatever the template makes of it."""
    answered(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "chat_template_kwargs": kwargs})
    alive_and_clean(server)


@pytest.fixture(scope="module")
def junk_files(tmp_path_factory):
    """Paths a LoRA load may be pointed at: missing, a file, empty dirs, dirs with broken configs and weights."""
    root = tmp_path_factory.mktemp("lora-junk")
    made = {"missing": str(root / "missing"), "file": str(root / "file"), "empty": str(root / "empty")}
    (root / "file").write_bytes(os.urandom(64))
    (root / "empty").mkdir()
    for name, config, weights in [
            ("bad-json", b"{", b""),
            ("not-object", b"[1]", b""),
            ("regex", json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {"(": 4}})
             .encode(), b""),
            ("header-lies", json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}).encode(),
             (10**12).to_bytes(8, "little") + b"{}"),
            ("junk-weights", json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}).encode(),
             os.urandom(256))]:
        path = root / name
        path.mkdir()
        (path / "adapter_config.json").write_bytes(config)
        (path / "adapter_model.safetensors").write_bytes(weights)
        made[name] = str(path)
    return made


@FUZZ
@given(data=st.data())
def test_lora_load_bodies_never_answer_5xx(server, junk_files, data):
    path = data.draw(st.one_of(st.sampled_from(sorted(junk_files.values())), st.text(max_size=20), json_values))
    body = data.draw(st.sampled_from([
        {"lora_name": data.draw(st.text(max_size=10)), "lora_path": path},
        {"lora_name": data.draw(json_values), "lora_path": path},
        {"lora_path": path},
        data.draw(json_values)]))
    status = answered(server.url, "/v1/load_lora_adapter", body)
    if status == 200:  # a junk path never loads; if something did, take it out again so that slots stay free
        answered(server.url, "/v1/unload_lora_adapter", {"lora_name": body["lora_name"]})
    alive_and_clean(server)


# ---- Anthropic's Messages API: bodies right in shape but for a value here and there ----

BLOCK_TYPES = ["text", "text", "tool_result", "tool_use", "thinking", "image", "document", "redacted_thinking", "x"]
BLOCK_FIELDS = {"text": ["type", "text"], "tool_use": ["type", "id", "name", "input"],
                "tool_result": ["type", "tool_use_id", "content"], "thinking": ["type", "thinking", "signature"]}


def rarely(draw, right, wrong=json_values):
    """right, or one time in eight `wrong` (hypothesis leans to small draws: the wrong one comes at 7)."""
    return draw(wrong) if draw(st.integers(0, 7)) == 7 else draw(right)


@st.composite
def blocks(draw):
    """A block of its kind's fields (now and then some missing or others added), or any JSON value."""
    kind = draw(st.sampled_from(BLOCK_TYPES))
    block = {"type": kind, "text": rarely(draw, st.text(max_size=8)), "id": "t1", "name": "f",
             "input": rarely(draw, st.just({"x": 1})), "tool_use_id": "t1",
             "content": rarely(draw, st.one_of(st.text(max_size=8), st.lists(st.fixed_dictionaries(
                 {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=5)}), max_size=2))),
             "thinking": "hm", "signature": "s", "data": "d", "cache_control": {"type": "ephemeral"},
             "is_error": draw(scalars), "citations": draw(json_values)}
    fields = set(BLOCK_FIELDS.get(kind, ["type"]))
    keep = rarely(draw, st.just(fields), st.sets(st.sampled_from(sorted(block)), max_size=5))
    return rarely(draw, st.just({k: block[k] for k in keep | {"type"}}))


@st.composite
def message_bodies(draw, count: bool):
    turn = st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["user", "assistant", "user", "assistant", "user", "system", "tool"]),
                     st.one_of(st.text(max_size=8), st.lists(blocks(), max_size=3)))
    tool = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "", "a b"]), "input_schema": schemas()})
    optional = {
        "system": st.one_of(st.text(max_size=8), st.lists(blocks(), max_size=2)),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool", "x"])},
                                             optional={"name": st.sampled_from(["f", "g"]),
                                                       "disable_parallel_tool_use": scalars}),
        "stop_sequences": st.lists(st.text(max_size=4), max_size=3), "temperature": st.floats(-1, 3),
        "top_p": st.floats(-1, 2), "top_k": st.integers(-2, 400),
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "adaptive", "disabled", "x"])},
                                          optional={"budget_tokens": st.integers(0, 3000)}),
        "stream": st.booleans(), "metadata": st.fixed_dictionaries({"user_id": st.text(max_size=4)}),
        "service_tier": st.sampled_from(["auto", "priority"]), "container": scalars,
        "model": st.sampled_from(["tiny", "other"])}
    if count:  # count_tokens takes no sampling fields
        optional = {k: v for k, v in optional.items() if k in ("system", "tools", "tool_choice", "thinking", "model")}
    body = {"model": "tiny", "messages": rarely(draw, st.lists(turn, min_size=1, max_size=3))}
    for key in draw(st.sets(st.sampled_from(sorted(optional)), max_size=3)):
        body[key] = rarely(draw, optional[key])
    if not count:
        body["max_tokens"] = rarely(draw, st.integers(1, 3), st.one_of(st.integers(-1, 0), json_values))
    return rarely(draw, st.just(body))


@FUZZ
@given(data=st.data(), count=st.booleans())
def test_messages_bodies_never_answer_5xx(server, data, count):
    body = data.draw(message_bodies(count))
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    status, raw = http("POST", server.url + path, body)
    assert status < 500, f"{status} for {json.dumps(body)[:2000]}: {raw[:500]!r}"
    if status >= 400:  # Anthropic's error, never a traceback
        error = json.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], error
        assert "Traceback" not in error["error"]["message"]
    elif not count and isinstance(body, dict) and body.get("stream") is True:
        assert raw.endswith(b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n"), raw[-300:]
    alive_and_clean(server)
