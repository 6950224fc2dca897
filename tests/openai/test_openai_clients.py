"""Structured output and tool calls end to end, through the official `openai` client (and LangChain) against the
server: whole and streamed, every constrained output parsed and validated."""
import json
import re

import openai
import pydantic
import pytest

from jaxserve.server.served_model import AutoTools

from fake_runner import ScriptedRunner, fake_llm
from locations import DATA
from serving import ServerThread, wait_idle
from tool_call_checks import ASK, TOOLS, GetTime, GetWeather

TEMPLATE = (DATA / "hermes_tools_template.jinja").read_text()


def client(st):
    return openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)


# ---- auto: a model that writes Hermes tool calls by itself (scripted tokens) ----

SCRIPT = ('Let me check.\n<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "GetTime", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path):
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights.gguf import open_gguf
    return Tokenizer.from_gguf_fields(open_gguf(default_gguf_path))


def scripted_server(tokenizer, text: str, **server_args) -> ServerThread:
    """A server whose model writes `text` (then <|im_end|>) whatever it is asked, under a Hermes chat template, with
    tool_choice auto served (--enable-auto-tool-choice) unless server_args say otherwise."""
    tokenizer.chat_template = TEMPLATE
    runner = ScriptedRunner(tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0],
                            tokenizer.vocab_size)
    llm = fake_llm(vocab_size=tokenizer.vocab_size, max_model_len=512, tokenizer=tokenizer, num_pages=512,
                   max_num_batched_tokens=128, runner=runner)
    return ServerThread(llm, "scripted", **{"auto_tools": AutoTools(enabled=True), **server_args})


@pytest.fixture(scope="module")
def scripted(default_tokenizer):
    st = scripted_server(default_tokenizer, SCRIPT)
    yield st
    st.stop()


def test_auto_tool_calls_whole(scripted):
    c = client(scripted)
    r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, n=2, temperature=1)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        calls = choice.message.tool_calls
        assert [(t.type, t.function.name) for t in calls] == [("function", "GetWeather"), ("function", "GetTime")]
        assert GetWeather.model_validate_json(calls[0].function.arguments) == GetWeather(city="Paris", days=2)
        assert GetTime.model_validate_json(calls[1].function.arguments) == GetTime(zone="CET")
    ids = [t.id for choice in r.choices for t in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 4
    # parse() reads the arguments into the tools' models.
    parsed = c.chat.completions.parse(model="scripted", messages=ASK, tools=TOOLS).choices[0].message
    assert parsed.tool_calls[0].function.parsed_arguments == GetWeather(city="Paris", days=2)
    # Without parallel calls: the first only. tool_choice none: the text as the model wrote it.
    r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["GetWeather"]
    r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == SCRIPT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    wait_idle(scripted)


def test_auto_tool_calls_streamed(scripted):
    c = client(scripted)
    with c.chat.completions.stream(model="scripted", messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert [t.function.parsed_arguments for t in message.tool_calls] == [GetWeather(city="Paris", days=2),
                                                                        GetTime(zone="CET")]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["GetWeather", "GetTime"]
    # The raw chunks: each call opens with its index, id, type, name and empty arguments.
    chunks = list(c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True))
    entries = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []]
    firsts = [t for t in entries if t.id]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in firsts] == [
        (0, "function", "GetWeather", ""), (1, "function", "GetTime", "")]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Let me check."
    wait_idle(scripted)


def test_auto_malformed_call_is_text(default_tokenizer):
    text = 'Hmm.\n<tool_call>\n{"name": "GetWeather", "arguments": {city: Paris}}\n</tool_call>'
    st = scripted_server(default_tokenizer, text)
    try:
        c = client(st)
        r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        chunks = list(c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
        assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
    finally:
        st.stop()


def test_auto_with_tags_that_are_special_tokens(default_gguf_path):
    """Where <tool_call> and </tool_call> are special tokens (decoding drops them by default), auto calls still
    parse: the server keeps special tokens in such a request's text."""
    from tokenizers import AddedToken

    from jaxserve.openai.tool_parsers import tags_are_special
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights.gguf import open_gguf
    tok = Tokenizer.from_gguf_fields(open_gguf(default_gguf_path))
    assert not tags_are_special(tok)
    inner = tok._tok
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok = Tokenizer(inner, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids, add_bos=tok.add_bos,
                    chat_template=None)
    assert tags_are_special(tok) and tok.vocab_size == 49154
    st = scripted_server(tok, SCRIPT)
    try:
        r = client(st).chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["GetWeather", "GetTime"]
        assert r.choices[0].message.content == "Let me check."
    finally:
        st.stop()


def test_auto_on_a_template_without_tool_calls_is_400(tmp_path, default_tokenizer):
    st = ServerThread(fake_llm(vocab_size=49152, max_model_len=64, tokenizer=default_tokenizer.__class__.from_hf_dir(
        _saved(default_tokenizer, tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}"))), "plain",
        auto_tools=AutoTools(enabled=True))
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(st).chat.completions.create(model="plain", messages=ASK, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]
    finally:
        st.stop()


def test_auto_needs_the_flag(default_tokenizer):
    """As vLLM: tool_choice auto (the default with tools) is a 400 naming --enable-auto-tool-choice without it,
    even where the template's format is known; the other choices need no flag."""
    st = scripted_server(default_tokenizer, SCRIPT, auto_tools=None)
    try:
        c = client(st)
        for choice in ("auto", None):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                          **({"tool_choice": choice} if choice else {}))
            assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
        r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none")
        assert r.choices[0].message.content == SCRIPT
    finally:
        st.stop()


def _saved(tokenizer, path, template):
    old = tokenizer.chat_template
    tokenizer.chat_template = template
    tokenizer.save(path)
    tokenizer.chat_template = old
    return path


# ---- structured output and enforced tool calls on real models ----

class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=150)
    likes: list[str] = pydantic.Field(max_length=3)


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    days: int = pydantic.Field(ge=1, le=14)


class Clock(pydantic.BaseModel):
    zone: str = pydantic.Field(pattern=r"^[A-Z]{3}$")


REAL_TOOLS = [openai.pydantic_function_tool(Forecast), openai.pydantic_function_tool(Clock)]
PERSON = [{"role": "user", "content": "Describe a person as JSON: name, age, likes."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def validate(schema: dict, instance) -> None:
    import jsonschema
    jsonschema.Draft202012Validator(schema).validate(instance)


def check_tool_calls(message, tools: list, count=None) -> None:
    """Every call names one of the tools and its arguments validate against that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls and (count is None or len(message.tool_calls) == count)
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        validate(schemas[call.function.name], json.loads(call.function.arguments))
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


@pytest.fixture(scope="module")
def smol(default_llm):
    st = ServerThread(default_llm, "smol")
    yield st
    st.stop()


def test_parse_json_object_and_schema_streamed(smol):
    c = client(smol)
    r = c.chat.completions.parse(model="smol", messages=PERSON, response_format=Person, temperature=0,
                                 max_tokens=150)
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and Person.model_validate_json(r.choices[0].message.content) == person
    # Streamed: the same greedy JSON, parsed by the stream helper.
    with c.chat.completions.stream(model="smol", messages=PERSON, response_format=Person, temperature=0,
                                   max_tokens=150) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == person
    # json_object: any object; n=2 sampled with a seed.
    r = c.chat.completions.create(model="smol", messages=PERSON, response_format={"type": "json_object"}, n=2,
                                  temperature=0.7, seed=7, max_tokens=150)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content
    # A raw json_schema (strict false), on completions too.
    schema = {**Forecast.model_json_schema(), "additionalProperties": False}
    r = c.completions.create(model="smol", prompt="Weather forecast as JSON:", max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                 "name": "forecast", "schema": schema, "strict": False}}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    validate(schema, json.loads(r.choices[0].text))
    wait_idle(smol)


def test_choice_regex_and_grammar(smol):
    c = client(smol)
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Is Paris in France?"}],
                                  temperature=0, max_tokens=5, extra_body={"structured_outputs": {
                                      "choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="smol", prompt="Call me at", max_tokens=20, temperature=1, seed=3, n=2,
                             extra_body={"guided_regex": r" \d{3}-\d{4}"})
    for choice in r.choices:
        assert re.fullmatch(r" \d{3}-\d{4}", choice.text) and choice.finish_reason == "stop"
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/'
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is 6 times 7?"}],
                                  temperature=0, max_tokens=20, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", r.choices[0].message.content)
    # Streamed: the pieces make the whole.
    chunks = list(c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is 6x7?"}],
                                            temperature=0, max_tokens=20, stream=True,
                                            extra_body={"structured_outputs": {"grammar": grammar}}))
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", "".join(ch.choices[0].delta.content or ""
                                                                    for ch in chunks))
    wait_idle(smol)


def test_required_and_named_tool_calls(smol):
    c = client(smol)
    for parallel in (True, False):
        r = c.chat.completions.create(model="smol", messages=WEATHER, tools=REAL_TOOLS, tool_choice="required",
                                      parallel_tool_calls=parallel, temperature=0, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        check_tool_calls(r.choices[0].message, REAL_TOOLS, None if parallel else 1)
    # Named: that function's arguments, read into its model by parse().
    r = c.chat.completions.parse(model="smol", messages=WEATHER, tools=REAL_TOOLS, temperature=0, max_tokens=80,
                                 tool_choice={"type": "function", "function": {"name": "Clock"}})
    message = r.choices[0].message
    check_tool_calls(message, REAL_TOOLS, 1)
    assert message.tool_calls[0].function.name == "Clock"
    assert isinstance(message.tool_calls[0].function.parsed_arguments, Clock)
    # Streamed required calls, reassembled by the stream helper: the same as whole.
    whole = c.chat.completions.create(model="smol", messages=WEATHER, tools=REAL_TOOLS, tool_choice="required",
                                      temperature=0, max_tokens=120).choices[0].message
    with c.chat.completions.stream(model="smol", messages=WEATHER, tools=REAL_TOOLS, tool_choice="required",
                                   temperature=0, max_tokens=120) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in streamed.tool_calls] == [
        (t.function.name, t.function.arguments) for t in whole.tool_calls]
    assert all(isinstance(t.function.parsed_arguments, (Forecast, Clock)) for t in streamed.tool_calls)
    wait_idle(smol)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_grammar_that_does_not_compile_is_400_naming_the_field(smol, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(smol).chat.completions.create(model="smol", messages=PERSON, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param)
    wait_idle(smol)


def test_langchain_with_structured_output(smol):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=smol.url + "/v1", api_key="unused", model="smol", temperature=0, max_tokens=150,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):  # response_format json_schema; a named tool call
        person = llm.with_structured_output(Person, method=method).invoke(PERSON[0]["content"])
        assert isinstance(person, Person), method
    wait_idle(smol)


def test_gemma3_json_schema_and_required_tool_call(gemma3_llm):
    st = ServerThread(gemma3_llm, "gemma")
    try:
        c = client(st)
        r = c.chat.completions.parse(model="gemma", messages=PERSON, response_format=Person, temperature=0,
                                     max_tokens=150)
        assert isinstance(r.choices[0].message.parsed, Person)
        # One call (with parallel calls, this model repeats its call until max_tokens).
        r = c.chat.completions.create(model="gemma", messages=WEATHER, tools=REAL_TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, temperature=0, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls"
        check_tool_calls(r.choices[0].message, REAL_TOOLS, 1)
        wait_idle(st)
    finally:
        st.stop()


def test_auto_on_a_tiny_qwen3_with_a_hermes_template(tmp_path):
    """A real (random) Qwen3 behind a Hermes template, its output held to the Hermes format by a grammar: the auto
    path's parser reads the calls, whole and streamed."""
    from jaxserve import LLM

    from hf_models import save_tiny_chat_model
    save_tiny_chat_model("qwen3", tmp_path, TEMPLATE)
    st = ServerThread(LLM(str(tmp_path), dtype="float32", max_model_len=512, max_num_seqs=2, max_num_batched_tokens=128,
                          warmup=False), "qwen3", auto_tools=AutoTools("hermes", enabled=True))
    call = {"type": "object", "properties": {"name": {"const": "Forecast"},
                                             "arguments": REAL_TOOLS[0]["function"]["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False,
            # As the server's own JSON schemas are compiled: no free whitespace (a random model pads forever).
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    hermes = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(call)}'
    try:
        c = client(st)
        args = dict(model="qwen3", messages=WEATHER, tools=REAL_TOOLS, tool_choice="auto", temperature=1, seed=0,
                    max_tokens=120, extra_body={"structured_outputs": {"grammar": hermes}})
        r = c.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        check_tool_calls(r.choices[0].message, REAL_TOOLS, 1)
        with c.chat.completions.stream(**args) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.tool_calls[0].function.arguments == \
            r.choices[0].message.tool_calls[0].function.arguments  # the same seed: the same call
        assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, Forecast)
        wait_idle(st)
    finally:
        st.stop()
