"""Tool calls without an engine: the request's tools and tool_choice, the grammar that enforces required and named
calls (checked with jsonschema), the parsers of a choice's text (whole and fed in random pieces), messages with
tool calls and tool results, and a Hermes chat template rendered as HF transformers renders it."""
import json
import random

import jsonschema
import pytest

from jaxserve.openai.chat_messages import render_chat
from jaxserve.openai.errors import ApiError
from jaxserve.openai.requests import parse_chat
from jaxserve.openai.structured import FieldError
from jaxserve.openai.tool_call_parsers import detect_tool_parser
from jaxserve.openai.tool_calls import parse_tools
from jaxserve.openai.tool_parsers import (
    HERMES_END,
    HERMES_START,
    ArrayCalls,
    HermesCalls,
    NamedCall,
    assemble,
)

from locations import DATA
from tool_call_checks import check_stream_shape

TEMPLATE = (DATA / "hermes_tools_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields):
    return parse_chat({"messages": MESSAGES, "tools": TOOLS, **fields})


# ---- the request ----

def test_tool_choice_kinds():
    assert parse_tools({"messages": []}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    auto = parse_tools({"tools": TOOLS})
    assert auto.choice == "auto" and auto.parallel and auto.structured_outputs() is None
    assert list(auto.functions) == ["get_weather", "get_time"] and auto.tools == TOOLS
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).structured_outputs() is None
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.choice == "function" and named.named == "get_time"
    assert named.structured_outputs().json == TIME
    # No parameters: an object with none.
    bare = parse_tools({"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"})
    assert bare.functions["ping"].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_grammar_is_an_array_of_calls(parallel):
    """The schema's instances are exactly the calls: each {name, arguments} valid for that function."""
    body = {"tools": TOOLS, "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    schema = parse_tools(body).structured_outputs().json
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = lambda x: jsonschema.Draft202012Validator(schema).is_valid(x)  # noqa: E731
    one = {"name": "get_weather", "arguments": {"city": "Paris"}}
    two = {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert ok([one]) and ok([two])
    assert ok([one, two]) is (parallel is not False)
    assert not ok([])  # at least one call
    assert not ok([{"name": "get_weather", "arguments": {"zone": "UTC"}}])  # another function's arguments
    assert not ok([{"name": "get_time", "arguments": {"zone": "PST"}}])
    assert not ok([{"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}])
    assert not ok([{"name": "nope", "arguments": {}}])
    assert not ok([{"name": "get_weather"}])
    assert not ok([{**one, "extra": 1}])


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required", "tools": []}, "tool_choice"),  # a tool_choice without tools
    ({"tool_choice": "auto", "tools": None}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),  # two grammars
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),  # two functions of one name
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_auto_and_none_leave_room_for_response_format():
    for choice in ("auto", "none"):
        _, params, tools = chat(tool_choice=choice, response_format={"type": "json_object"})
        assert params.structured_outputs.json_object and tools.choice == choice


def test_auto_needs_a_parser():
    tools = parse_tools({"tools": TOOLS})
    assert detect_tool_parser(TEMPLATE) == "hermes"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
    assert isinstance(tools.parser(HermesCalls), HermesCalls)
    with pytest.raises(FieldError) as e:
        tools.parser(None)
    assert e.value.field == "tool_choice"
    # required and named need no template support: the grammar makes the format.
    assert isinstance(parse_tools({"tools": TOOLS, "tool_choice": "required"}).parser(None), ArrayCalls)
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).parser(None) is None


# ---- parsing the output ----

def fed(parser, text: str, rng: random.Random) -> list[dict]:
    """The parser's deltas with the text fed in random pieces (as a stream's detokenized deltas come)."""
    deltas, i = [], 0
    while i < len(text):
        k = rng.randint(0, 6)
        deltas += parser.feed(text[i:i + k])
        i += k
    return deltas + parser.finish()


def random_json(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + ["list", "dict"] * (depth < 3)
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3)
    if kind == "str":
        return "".join(rng.choice('ab ,:{}[]"\\\n\té東😀') for _ in range(rng.randint(0, 8)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def dumps(x, rng: random.Random) -> str:
    return json.dumps(x, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 1, 2]))


@pytest.mark.parametrize("seed", range(20))
def test_array_calls_whole_and_incremental(seed):
    """required's output: every call with its arguments' exact text, whatever the pieces and the layout."""
    rng = random.Random(seed)
    calls = [{"name": rng.choice(["f", "get_weather", "a-b"]), "arguments": random_json(rng, 1)}
             for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:  # the arguments before the name: held back until the name is read
        calls = [{"arguments": c["arguments"], "name": c["name"]} for c in calls]
    text = dumps(calls, rng)
    whole = ArrayCalls().feed(text)
    check_stream_shape(whole)
    pieces = fed(ArrayCalls(), text, rng)
    check_stream_shape(pieces)
    for deltas in (whole, pieces):
        content, got = assemble(deltas)
        assert content is None, f"seed {seed}"
        assert [c["function"]["name"] for c in got] == [c["name"] for c in calls], f"seed {seed}"
        assert [json.loads(c["function"]["arguments"]) for c in got] == [c["arguments"] for c in calls], f"seed {seed}"
    assert len({c["id"] for c in assemble(pieces)[1] + assemble(whole)[1]}) == 2 * len(calls)  # ids are unique


def test_named_call():
    rng = random.Random(0)
    deltas = fed(NamedCall("get_time"), '{"zone": "UTC"}', rng)
    check_stream_shape(deltas)
    assert assemble(deltas) == (None, [{"id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                                        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}])


def hermes(text: str, seed: int, parallel: bool = True):
    """(whole, fed in pieces): each assembled; they must agree."""
    functions = parse_tools({"tools": TOOLS}).functions
    whole = HermesCalls(functions, parallel)
    whole_deltas = whole.feed(text) + whole.finish()
    pieces = fed(HermesCalls(functions, parallel), text, random.Random(seed))
    check_stream_shape(whole_deltas)
    check_stream_shape(pieces)
    a, b = assemble(whole_deltas), assemble(pieces)
    strip_ids = lambda m: (m[0], [c["function"] for c in m[1]])  # noqa: E731
    assert strip_ids(a) == strip_ids(b), f"seed {seed}: {text!r}"
    # Streamed content is never taken back: it is the whole's, in order.
    assert "".join(d.get("content", "") for d in pieces) == (a[0] or "")
    return strip_ids(a)


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL_T = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
W = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
T = {"name": "get_time", "arguments": '{"zone": "CET"}'}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text, expected", [
    (CALL_W, (None, [W])),
    ("Let me look.\n\n" + CALL_W, ("Let me look.", [W])),
    (CALL_W + "\n" + CALL_T + "\n", (None, [W, T])),
    (CALL_W + " and then " + CALL_T, ("and then", [W, T])),  # content between calls stays (stripped at the calls)
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', (None, [T])),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', (None, [T])),  # unclosed at the end: a call
    # Malformed: text, as it came.
    ('<tool_call>{"name": "get_time", "arguments": {zone: CET}}</tool_call>',
     ('<tool_call>{"name": "get_time", "arguments": {zone: CET}}</tool_call>', [])),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}', ('<tool_call>{"name": "get_time", '
                                                                       '"arguments": {"zone": "CET"}', [])),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not one of the tools
     ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', [])),
    ('<tool_call>["get_time"]</tool_call>', ('<tool_call>["get_time"]</tool_call>', [])),
    # A name no dict lookup takes (a TypeError out of the parser, once).
    ('<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
     ('<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', [])),
    # A good call beside a malformed one: the call, and the bad block as text.
    (CALL_T + '<tool_call>{"name": }</tool_call>', ('<tool_call>{"name": }</tool_call>', [T])),
    ('So:\n <tool_call>{"name": }</tool_call> ' + CALL_T, ('So:\n <tool_call>{"name": }</tool_call>', [T])),
    # No call: the text exactly, whitespace and tag-like pieces included.
    ("Plain answer, with < and <tool and </tool_call>.  \n", ("Plain answer, with < and <tool and </tool_call>.  \n",
                                                             [])),
    ("", ("", [])),
])
def test_hermes_whole_and_incremental(text, expected, seed):
    assert hermes(text, seed) == expected


DEEP = "[" * 5000 + "]" * 5000  # nested past Python's recursion limit


@pytest.mark.parametrize("block", [
    DEEP,
    '{"name": "get_time", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
    '{"name": "get_time", "arguments": "' + DEEP + '"}',  # as JSON text
], ids=["block", "arguments", "arguments-text"])
@pytest.mark.parametrize("closed", [True, False])
def test_hermes_takes_json_nested_too_deeply_as_text(block, closed):
    """Item 15: json.loads raised RecursionError out of the parser (a model can write "[" five thousand times)."""
    text = HERMES_START + block + (HERMES_END if closed else "")
    assert hermes(text, 0) == (text, [])


def test_hermes_without_parallel_calls_keeps_the_first():
    assert hermes(CALL_W + "\n" + CALL_T + " trailing", 0, parallel=False) == (None, [W])


# ---- messages and the chat template ----

PAST = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:02"}]},
    {"role": "assistant", "content": "Sunny, 21 C; it is 14:02."},
    {"role": "user", "content": "Thanks. Tomorrow?"},
]


def test_messages_with_tool_calls_and_results():
    messages, _, tools = parse_chat({"messages": PAST, "tools": TOOLS})
    assert "content" not in messages[2]  # a turn of calls only, as HF's examples write it
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for the template
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "14:02"}
    assert PAST[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "x"},  # no tool_call_id
    {"role": "assistant", "content": None},
    {"role": "assistant", "tool_calls": "call"},
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": "{bad"}}]},
    {"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "function", "content": "x"},
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
    # Deeper than json's parser can recurse (a RecursionError, once a 500).
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]},
])
def test_bad_messages(message):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}, message]})
    assert e.value.status == 400 and e.value.param == "messages"


@pytest.fixture(scope="module")
def qwen3_tools_dir(tmp_path_factory):
    from hf_models import save_tiny_chat_model
    path = tmp_path_factory.mktemp("qwen3-tools")
    save_tiny_chat_model("qwen3", path, TEMPLATE)
    return path


def test_chat_template_with_tools_as_hf_renders_it(qwen3_tools_dir):
    """The request path (parse_chat, render_chat) renders what HF's apply_chat_template(tools=...) renders from
    the same conversation (tool-call arguments as objects), and the template sees the tools, the calls and the
    results."""
    import transformers

    from jaxserve.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_dir(qwen3_tools_dir)
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_tools_dir)
    hf_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                           "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in PAST]
    hf_messages[4] = {**PAST[4], "content": "14:02"}
    for conversation, hf_conversation, tools in [(PAST, hf_messages, TOOLS), (PAST[:2], hf_messages[:2], None),
                                                 (PAST[1:2], hf_messages[1:2], TOOLS)]:
        body = {"messages": conversation} if tools is None else {"messages": conversation, "tools": tools}
        messages, _, parsed = parse_chat(body)
        ours = render_chat(messages, tok, parsed)
        theirs = hf.apply_chat_template(hf_conversation, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert tok.encode(ours, add_special_tokens=False) == hf(theirs, add_special_tokens=False)["input_ids"]
    assert '"name": "get_weather", "description": "The weather in a city"' in ours  # the tools
    full = render_chat(parse_chat({"messages": PAST, "tools": TOOLS})[0], tok, parse_tools({"tools": TOOLS}))
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>' in full  # the calls
    assert '<tool_response id="call_2">\n14:02\n</tool_response>' in full  # the results
