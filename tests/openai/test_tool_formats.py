"""The tool-call parsers beyond Hermes (llama3_json, mistral, qwen3_coder), without an engine: the formats'
documented examples fed whole, split at every boundary, one character at a time and in random pieces (seeded, and
hypothesis's), giving the same calls; malformed calls are content as the model wrote them; the parser a chat
template implies."""
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.openai.tool_call_parsers import TOOL_PARSERS, detect_tool_parser, tool_parser_class
from jaxserve.openai.tool_calls import parse_tools
from jaxserve.openai.tool_json_formats import Llama3JsonCalls, MistralCalls
from jaxserve.openai.tool_parsers import assemble
from jaxserve.openai.tool_xml_format import Qwen3CoderCalls, convert

from tool_call_checks import check_stream_shape

# The tools of the formats' own examples: Llama 3.1's model card (get_current_conditions), Mistral 7B Instruct
# v0.3's (get_current_weather), Qwen3-Coder's (square_the_number); and one of every JSON type for the XML format.
CONDITIONS = {"type": "function", "function": {
    "name": "get_current_conditions", "description": "Get the current weather conditions for a specific location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g., San Francisco, CA"},
        "unit": {"type": "string", "enum": ["Celsius", "Fahrenheit"]}}, "required": ["location", "unit"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location", "format"]}}}
SQUARE = {"type": "function", "function": {
    "name": "square_the_number", "description": "output the square of the number.",
    "parameters": {"type": "object", "required": ["input_num"], "properties": {
        "input_num": {"type": "number", "description": "input_num is a number that will be squared"}}}}}
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"type": ["integer", "null"]}}}}}
FUNCTIONS = parse_tools({"tools": [CONDITIONS, WEATHER, SQUARE, TYPED]}).functions


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


SF = call("get_current_conditions", location="San Francisco, CA", unit="Fahrenheit")
PARIS = call("get_current_weather", location="Paris, France", format="celsius")
SQ = call("square_the_number", input_num=1024)

# (parser, the model's output, (content, calls)): the documented examples first.
CASES = [
    # Llama 3.1 model card, JSON based tool calling (the answer before <|eot_id|>).
    (Llama3JsonCalls, '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                      '"unit": "Fahrenheit"}}', (None, [SF])),
    (Llama3JsonCalls, '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "San Francisco, '
                      'CA", "unit": "Fahrenheit"}}; {"name": "get_current_weather", "arguments": {"location": "Paris, '
                      'France", "format": "celsius"}}', (None, [SF, PARIS])),
    (Llama3JsonCalls, '\n {"name": "square_the_number", "parameters": {"input_num": 1024}} ;\n', (None, [SQ])),
    (Llama3JsonCalls, "It is sunny in Paris.", ("It is sunny in Paris.", [])),
    (Llama3JsonCalls, "", ("", [])),
    # Mistral 7B Instruct v0.3's model card (tokenizers before v11), and mistral-common's v11 form.
    (MistralCalls, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                   '"format": "celsius"}}]', (None, [PARIS])),
    (MistralCalls, 'Let me check. [TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, '
                   'France", "format": "celsius"}}, {"name": "square_the_number", "arguments": {"input_num": 1024}}]',
     ("Let me check.", [PARIS, SQ])),
    (MistralCalls, '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
                   '[TOOL_CALLS]square_the_number[ARGS]{"input_num": 1024}', (None, [PARIS, SQ])),
    (MistralCalls, '[TOOL_CALLS]square_the_number{"input_num": 1024}', (None, [SQ])),  # [ARGS] decoded away
    (MistralCalls, "No tools needed [TOOL] here.", ("No tools needed [TOOL] here.", [])),
    # Qwen3-Coder's chat template writes calls so.
    (Qwen3CoderCalls, "<tool_call>\n<function=square_the_number>\n<parameter=input_num>\n1024\n</parameter>\n"
                      "</function>\n</tool_call>", (None, [SQ])),
    (Qwen3CoderCalls, "I will look.\n\n<tool_call>\n<function=get_current_weather>\n<parameter=location>\nParis, "
                      "France\n</parameter>\n<parameter=format>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
                      "<tool_call>\n<function=square_the_number>\n<parameter=input_num>\n1024.0\n</parameter>\n"
                      "</function>\n</tool_call>", ("I will look.", [PARIS, SQ])),
    (Qwen3CoderCalls, "<tool_call>\n<function=typed>\n<parameter=s>\n 12 \n</parameter>\n<parameter=i>\n7\n"
                      "</parameter>\n<parameter=n>\n2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>"
                      "\n{'k': [1, None]}\n</parameter>\n<parameter=a>\n[1, \"x\"]\n</parameter>\n<parameter=maybe>\n"
                      "null\n</parameter>\n<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>",
     (None, [call("typed", s=" 12 ", i=7, n=2.5, b=True, o={"k": [1, None]}, a=[1, "x"], maybe=None, extra="5")])),
    # The output ended inside the block, its parameter unclosed: read as vLLM reads it.
    (Qwen3CoderCalls, "<tool_call>\n<function=square_the_number>\n<parameter=input_num>\n3", (None, [
        call("square_the_number", input_num=3)])),
]

# Malformed: content, exactly as written (a call before it stays a call).
MALFORMED = [
    (Llama3JsonCalls, '{"name": "get_current_weather", "parameters": {location: Paris}}'),
    (Llama3JsonCalls, '{"name": "launch_missiles", "parameters": {}}'),  # not one of the tools
    (Llama3JsonCalls, '<|python_tag|>{"name": "square_the_number", "parameters": [1]}'),
    (Llama3JsonCalls, '{"name": "square_the_number", "parameters": {"input_num": 1}, "arguments": {}}'),
    (Llama3JsonCalls, '{"name": "square_the_number", "parameters": {"input_num": 1'),  # ended inside
    (Llama3JsonCalls, '{"answer": 42}'),  # JSON, but no call
    (Llama3JsonCalls, '{"name": ["square_the_number"], "parameters": {}}'),  # a name no dict lookup takes
    (Llama3JsonCalls, "<|python_tag|>brave_search.call(query=\"weather\")"),  # a built-in tool: not JSON
    (Llama3JsonCalls, "[" * 5000 + "]" * 5000),
    (MistralCalls, "[TOOL_CALLS] Sorry, I cannot."),
    (MistralCalls, '[TOOL_CALLS][{"name": "get_current_weather", "arguments": "Paris"}]'),
    (MistralCalls, '[TOOL_CALLS][{"name": "launch", "arguments": {}}]'),
    (MistralCalls, '[TOOL_CALLS][{"name": {"a": 1}, "arguments": {}}]'),
    (MistralCalls, '[TOOL_CALLS][{"name": "square_the_number", "arguments": {"input_num": 1}}'),  # unclosed
    (MistralCalls, '[TOOL_CALLS]launch[ARGS]{"a": 1}'),
    (MistralCalls, '[TOOL_CALLS]square_the_number[ARGS]{"input_num": '),
    (MistralCalls, "[TOOL_CALLS]" + "[" * 5000 + "]" * 5000),
    (Qwen3CoderCalls, "<tool_call>\n<function=launch>\n</function>\n</tool_call>"),
    (Qwen3CoderCalls, "<tool_call>\n{\"name\": \"square_the_number\", \"arguments\": {}}\n</tool_call>"),
    (Qwen3CoderCalls, "<tool_call>\nsquare_the_number(3)\n</tool_call>"),
]


def strip_ids(message):
    return message[0], [c["function"] for c in message[1]]


def parsed(cls, pieces: list[str], parallel: bool = True):
    """(content, calls without ids) of the pieces fed one after another; streamed content is the whole's."""
    parser = cls(FUNCTIONS, parallel)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    check_stream_shape(deltas)
    message = assemble(deltas)
    assert "".join(d.get("content", "") for d in deltas) == (message[0] or "")
    assert parser.calls == len(message[1])
    return strip_ids(message)


def chunkings(text: str, rng: random.Random):
    """Whole, split once at every boundary, a character at a time, and seeded random pieces."""
    yield [text]
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield list(text)
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(0, 9)
            pieces.append(text[i:i + k])
            i += k
        yield pieces


@pytest.mark.parametrize("cls, text, expected", CASES, ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_documented_calls_whole_and_in_pieces(cls, text, expected):
    seed = random.randrange(2 ** 32)
    for pieces in chunkings(text, random.Random(seed)):
        assert parsed(cls, pieces) == expected, f"seed {seed}: {pieces!r}"


@pytest.mark.parametrize("cls, text", MALFORMED, ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_malformed_calls_are_content(cls, text):
    seed = random.randrange(2 ** 32)
    for pieces in list(chunkings(text, random.Random(seed)))[::max(1, len(text) // 40)]:
        assert parsed(cls, pieces) == (text, []), f"seed {seed}: {pieces!r}"
    # After good calls, the malformed rest is content (the good calls stay).
    good = {Llama3JsonCalls: CASES[0][1] + "; ", MistralCalls: CASES[8][1], Qwen3CoderCalls: CASES[10][1] + "\n"}
    content, calls = parsed(cls, [good[cls] + (text[len("<|python_tag|>"):] if text.startswith("<|") else text)])
    assert len(calls) == 1 and content, content


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_chunkings_agree(data):
    cls, text, expected = data.draw(st.sampled_from(CASES + [(c, t, (t, [])) for c, t in MALFORMED[:8]]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert parsed(cls, pieces) == expected


@pytest.mark.parametrize("cls, text", [(Llama3JsonCalls, CASES[1][1]), (MistralCalls, CASES[7][1]),
                                       (Qwen3CoderCalls, CASES[11][1])])
def test_without_parallel_calls_the_first_is_kept(cls, text):
    content, calls = parsed(cls, [text], parallel=False)
    assert len(calls) == 1 and calls[0]["name"] in FUNCTIONS


def test_mistral_call_ids_are_nine_letters_and_digits():
    deltas = MistralCalls(FUNCTIONS).feed(CASES[7][1])
    ids = [e["id"] for d in deltas for e in d.get("tool_calls", []) if "id" in e]
    assert len(ids) == 2 and all(i.isalnum() and len(i) == 9 for i in ids) and ids[0] != ids[1]


def test_xml_values_follow_the_schema():
    assert convert("3", {"type": "integer"}) == 3 and convert("three", {"type": "integer"}) == "three"
    assert convert("4.0", {"type": "number"}) == 4 and convert("1e999", {"type": "number"}) == "1e999"
    assert convert("nan", {"type": "number"}) == "nan"
    assert convert("FALSE", {"type": "boolean"}) is False and convert("Null", {"type": "string"}) is None
    assert convert("{1, 2}", {"type": "object"}) == "{1, 2}"  # a Python set is no JSON
    assert convert("[1e999]", {"type": "array"}) == "[1e999]"  # nor is infinity
    assert convert("[" * 10000, {"type": "array"}) == "[" * 10000
    assert convert("x", None) == "x" and convert("7", {"enum": [7]}) == "7"  # no type: a string, as vLLM


def test_parser_names_and_templates():
    assert list(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "qwen3_coder"]
    assert detect_tool_parser("{{- '<tool_call>\\n<function=' + name + '>' }}<parameter=") == "qwen3_coder"
    assert detect_tool_parser("{{- '<tool_call>' }}") == "hermes"
    assert detect_tool_parser("{{- '[TOOL_CALLS]' + calls|tojson }}") == "mistral"
    assert detect_tool_parser('Respond in the format {"name": function name, "parameters": dictionary of argument '
                              'name and its value}.') == "llama3_json"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None
    assert tool_parser_class("mistral", "{{- '<tool_call>' }}") is MistralCalls  # a name beats the template
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        tool_parser_class("pythonic", None)
