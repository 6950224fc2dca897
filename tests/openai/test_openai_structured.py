"""Structured output in a request body (response_format, structured_outputs, guided_*) -> SamplingParams, and every
way one can be wrong -> a 400 naming the field. Pure parsing: no engine."""
import pytest

from jaxserve.openai.errors import ApiError
from jaxserve.openai.requests import grammar_error, grammar_field, parse_chat, parse_completion
from jaxserve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return parse_completion({"prompt": "x", **fields})[1].structured_outputs


def chat(**fields):
    return parse_chat({"messages": MESSAGES, **fields})[1].structured_outputs


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": False,
                                                                 "description": "an a"}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, StructuredOutputsParams(json={})),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutputsParams(json='{"type": "string"}')),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputsParams(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutputsParams(json_object=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[0-9]{3}", "guided_decoding_backend": "guidance"}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"guided_choice": ["a", "b"], "guided_decoding_backend": "auto"}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "x"', "guided_decoding_backend": "llguidance"},
     StructuredOutputsParams(grammar='start: "x"')),
    ({}, None),
])
def test_each_kind(parse, fields, expected):
    assert parse(**fields) == expected


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),  # no name
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schemas": {}}}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),  # vLLM's, not served here
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    # More than one at once.
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    # A lone surrogate (JSON's "\ud800" escape) no grammar can spell.
    ({"guided_regex": "a\ud800"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["a", "\udfff"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}}, "response_format"),
])
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_bad_fields_are_400_naming_them(parse, fields, param):
    with pytest.raises(ApiError) as e:
        parse(**fields)
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_the_field_a_grammar_error_is_blamed_on():
    assert grammar_field({"prompt": "x", "guided_regex": "("}) == "guided_regex"
    assert grammar_field({"prompt": "x", "response_format": {"type": "json_object"}}) == "response_format"
    assert grammar_field({"prompt": "x", "structured_outputs": {"grammar": "?"}}) == "structured_outputs"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert grammar_field({"messages": MESSAGES, "tools": tools, "tool_choice": "required"}) == "tools"
    assert grammar_field({"messages": MESSAGES, "tools": tools, "guided_json": SCHEMA}) == "guided_json"
    assert grammar_field({"prompt": "x"}) is None


def test_tools_are_chat_only():
    """Completions refuse tools and a tool_choice that asks for them, and accept the fields at their neutral values
    (wrappers that always send them worked before tools existed)."""
    for key, value in [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")]:
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "x", key: value})
        assert e.value.param == key
    parse_completion({"prompt": "x", "tools": [], "tool_choice": "none", "parallel_tool_calls": True})


def test_echo_with_max_completion_tokens_zero_scores_the_prompt():
    params = parse_completion({"prompt": "x", "echo": True, "max_completion_tokens": 0})[1]
    assert params.max_tokens == 0 and params.prompt_logprobs == 0


def test_a_grammar_error_is_named_after_the_request_field():
    e = grammar_error({"prompt": "x", "guided_regex": "("}, ValueError("structured_outputs.regex: unclosed group"))
    assert (e.status, e.param, e.message) == (400, "guided_regex", "guided_regex: unclosed group")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]
    e = grammar_error({"messages": MESSAGES, "tools": tools, "tool_choice": "required"},
                      ValueError("structured_outputs.json: unknown type objet"))
    assert (e.param, e.message) == ("tools", "tools: unknown type objet")


def _nested(depth: int) -> dict:
    """{"items": {"items": ...}} `depth` deep, built without recursion."""
    value: dict = {}
    for _ in range(depth):
        value = {"items": value}
    return value


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": _nested(3000)}, "guided_json"),
    ({"structured_outputs": {"json": _nested(3000)}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _nested(3000)}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(3000)}}]}, "tools"),
])
def test_a_field_nested_past_pythons_recursion_limit_is_400_naming_it(fields, param):
    """Its check (json.dumps) raised RecursionError, a 500: a body the parser read can still nest too deeply to
    write a few frames further down."""
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert (e.value.status, e.value.param) == (400, param) and "nested too deeply" in e.value.message
