"""Structured output and tool calls end to end, through the official `openai` client (and LangChain) against the
server: whole and streamed, every constrained output parsed and validated."""
import json
from pathlib import Path

import openai
import pydantic
import pytest

from fake_runner import ScriptedRunner, fake_llm
from serving import ServerThread, wait_idle

TEMPLATE = (Path(__file__).parent / "data" / "hermes_tools_template.jinja").read_text()


class GetWeather(pydantic.BaseModel):
    city: str
    days: int


class GetTime(pydantic.BaseModel):
    zone: str


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days, and the time in CET?"}]


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


def scripted_server(tokenizer, text: str) -> ServerThread:
    """A server whose model writes `text` (then <|im_end|>) whatever it is asked, under a Hermes chat template."""
    tokenizer.chat_template = TEMPLATE
    runner = ScriptedRunner(tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0],
                            tokenizer.vocab_size)
    llm = fake_llm(vocab_size=tokenizer.vocab_size, max_model_len=512, tokenizer=tokenizer, num_pages=512,
                   max_num_batched_tokens=128, runner=runner)
    return ServerThread(llm, "scripted")


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


def test_auto_on_a_template_without_tool_calls_is_400(tmp_path, default_tokenizer):
    st = ServerThread(fake_llm(vocab_size=49152, max_model_len=64, tokenizer=default_tokenizer.__class__.from_hf_dir(
        _saved(default_tokenizer, tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}"))), "plain")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(st).chat.completions.create(model="plain", messages=ASK, tools=TOOLS)
        assert e.value.body["param"] == "tool_choice"
    finally:
        st.stop()


def _saved(tokenizer, path, template):
    old = tokenizer.chat_template
    tokenizer.chat_template = template
    tokenizer.save(path)
    tokenizer.chat_template = old
    return path
