"""Anthropic's Messages API end to end, through the official `anthropic` client, unmodified, against the server:
whole and streamed answers, tool use (Hermes calls a scripted model writes; a call the default model is held to by
tool_choice, then its result continued), stop sequences, count_tokens, thinking through the real reasoning parser
(--reasoning-parser qwen3: the chat path's reasoning_content, tool calls and grammars after </think>), and errors
in Anthropic's shape."""
import json

import anthropic
import openai
import pytest

from jaxserve.server.served_model import AutoTools
from jaxserve.tokenizer import Tokenizer

from fake_runner import ScriptedRunner, fake_llm
from locations import DATA
from serving import ServerThread, http, wait_idle

KEY = "sk-messages"
THOUGHT, ANSWER = "The user asks the weather.", "Let me check."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}\n{CALL}"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(st, **kw):
    return anthropic.Anthropic(base_url=st.url, max_retries=0, **({"api_key": KEY} | kw))


def scripted_server(tiny_tokenized_dir, **server_args) -> tuple[ServerThread, ScriptedRunner, Tokenizer]:
    """The tiny byte tokenizer under a Hermes chat template; the model writes the runner's script (SCRIPT unless a
    test sets another) whatever it is asked; tool_choice auto served."""
    tok = Tokenizer.from_hf_dir(tiny_tokenized_dir)
    tok.chat_template = (DATA / "hermes_tools_template.jinja").read_text()
    runner = ScriptedRunner(tok.encode(SCRIPT, add_special_tokens=False), tok.eos_token_ids[0], tok.vocab_size)
    st = ServerThread(fake_llm(vocab_size=tok.vocab_size, max_model_len=4096, tokenizer=tok, num_pages=2048,
                               max_num_batched_tokens=256, runner=runner), "scripted", api_key=KEY,
                      auto_tools=AutoTools(enabled=True), **server_args)
    return st, runner, tok


@pytest.fixture(scope="module")
def scripted(tiny_tokenized_dir):
    st, _, _ = scripted_server(tiny_tokenized_dir)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def thinker(tiny_tokenized_dir):
    """The scripted model served with --reasoning-parser qwen3 (SCRIPT opens its <think> block itself)."""
    st, runner, tok = scripted_server(tiny_tokenized_dir, reasoning_parser="qwen3")
    yield st, runner, tok
    st.stop()


def test_create_whole_with_usage_equal_to_count_tokens(scripted):
    c = client(scripted)
    r = c.messages.create(model="scripted", max_tokens=500, system="Be brief.", messages=ASK)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "scripted"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == SCRIPT  # no tools: nothing parsed
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    counted = c.messages.count_tokens(model="scripted", system="Be brief.", messages=ASK).input_tokens
    # The same request through chat completions: the same prompt and completion.
    chat = openai.OpenAI(base_url=scripted.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="scripted", max_tokens=500, messages=[{"role": "system", "content": "Be brief."}, *ASK]).usage
    assert (chat.prompt_tokens, chat.completion_tokens) == (counted, r.usage.output_tokens)
    again = c.messages.create(model="scripted", max_tokens=500, system="Be brief.", messages=ASK)
    for u in (r.usage, again.usage):
        assert u.input_tokens + u.cache_read_input_tokens == counted and u.cache_creation_input_tokens == 0
        assert u.output_tokens == len(scripted.server.default.tokenizer.encode(SCRIPT)) + 1  # and the EOS
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache's
    wait_idle(scripted)


def raw_events(st, body) -> list[tuple[str, dict]]:
    import asyncio

    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(st.url + "/v1/messages", json={**body, "stream": True},
                              headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                return (await r.read()).decode()
    out = []
    for chunk in asyncio.run(go()).split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stream_text_and_final_message(scripted):
    with client(scripted).messages.stream(model="scripted", max_tokens=500, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SCRIPT and final.content[0].text == SCRIPT and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    events = raw_events(scripted, {"model": "scripted", "max_tokens": 500, "messages": ASK})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(e["type"] == n for n, e in events)
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    wait_idle(scripted)


def test_auto_tool_use_whole_and_streamed_then_its_result(scripted):
    c = client(scripted)
    r = c.messages.create(model="scripted", max_tokens=500, messages=ASK, tools=[WEATHER])
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].text == f"<think>{THOUGHT}</think>{ANSWER}"  # no reasoning parser: the text as written
    call = r.content[1]
    assert call.id.startswith("toolu_") and (call.name, call.input) == ("get_weather", {"city": "Paris"})
    with c.messages.stream(model="scripted", max_tokens=500, messages=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and any(e.type == "input_json" for e in events)
    follow = [*ASK, {"role": "assistant", "content": r.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]}]
    r2 = c.messages.create(model="scripted", max_tokens=500, messages=follow, tools=[WEATHER])
    assert r2.stop_reason == "tool_use"  # (the script again)
    longer = c.messages.count_tokens(model="scripted", messages=follow, tools=[WEATHER]).input_tokens
    assert longer > c.messages.count_tokens(model="scripted", messages=ASK, tools=[WEATHER]).input_tokens
    wait_idle(scripted)


def test_stop_sequences_and_max_tokens(scripted):
    c = client(scripted)
    r = c.messages.create(model="scripted", max_tokens=500, messages=ASK, stop_sequences=["xx", "check"])
    assert r.content[0].text == f"<think>{THOUGHT}</think>Let me "
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "check")
    with c.messages.stream(model="scripted", max_tokens=500, messages=ASK, stop_sequences=["check"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "check")
    r = c.messages.create(model="scripted", max_tokens=5, messages=ASK)
    assert (r.stop_reason, r.content[0].text, r.usage.output_tokens) == ("max_tokens", SCRIPT[:5], 5)
    wait_idle(scripted)


def test_thinking_through_the_reasoning_parser(scripted, thinker):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError) as e:  # no parser: reasoning cannot be told from the answer
        client(scripted).messages.create(model="scripted", max_tokens=2000, messages=ASK, thinking=thinking)
    assert "--reasoning-parser" in e.value.body["error"]["message"]
    st, runner, tok = thinker
    runner.script = tok.encode(SCRIPT, add_special_tokens=False)
    c = client(st)
    # The <tool_call> is parsed from the answer after </think>; the reasoning is never read as a call.
    r = c.messages.create(model="scripted", max_tokens=2000, messages=ASK, thinking=thinking, tools=[WEATHER])
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
    assert (r.content[0].thinking, r.content[1].text, r.content[2].input) == (THOUGHT, ANSWER,
                                                                              {"city": "Paris"})
    with c.messages.stream(model="scripted", max_tokens=2000, messages=ASK, thinking=thinking) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == THOUGHT
    assert not any("think>" in getattr(b, "text", "") for b in final.content)
    unasked = c.messages.create(model="scripted", max_tokens=2000, messages=ASK)  # dropped, as Anthropic
    assert [b.type for b in unasked.content] == ["text"] and unasked.content[0].text == f"{ANSWER}\n{CALL}"
    # the tokens counted are all the model wrote, its reasoning's too (and the EOS)
    assert unasked.usage.output_tokens == len(tok.encode(SCRIPT, add_special_tokens=False)) + 1
    wait_idle(st)


@pytest.mark.parametrize("choice, answer", [
    ({"type": "tool", "name": "get_weather"}, '{"city": "Paris"}'),
    ({"type": "any"}, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')])
def test_a_forced_tool_call_is_held_to_its_grammar_after_the_reasoning(thinker, choice, answer):
    """tool_choice any / tool: the grammar applies from the token after </think> (the reasoning, here text no
    JSON grammar takes, is free), as in chat completions; without that the first token is refused."""
    st, runner, tok = thinker
    thought = 'The schema wants {"city": a string, so { "city": "Paris" } it is.\n'
    runner.script = tok.encode(f"<think>{thought}</think>{answer}", add_special_tokens=False)
    try:
        for thinking in ({"type": "enabled", "budget_tokens": 1024}, None):
            r = client(st).messages.create(model="scripted", max_tokens=2000, messages=ASK, tools=[WEATHER],
                                           tool_choice=choice, **({"thinking": thinking} if thinking else {}))
            assert [b.type for b in r.content] == ["thinking", "tool_use"][0 if thinking else 1:], r.content
            assert (r.content[-1].name, r.content[-1].input, r.stop_reason) == ("get_weather", {"city": "Paris"},
                                                                                "tool_use")
            if thinking:
                assert r.content[0].thinking == thought
    finally:
        runner.script = tok.encode(SCRIPT, add_special_tokens=False)
    wait_idle(st)


def test_errors_in_anthropic_shape(scripted):
    c = client(scripted)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="nope", messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="scripted", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image blocks are not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="scripted", max_tokens=5, messages=ASK, extra_body={"container": "c"})
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": "unknown field 'container'"}
    status, raw = http("POST", scripted.url + "/v1/messages", {"model": "scripted", "messages": ASK})
    assert status == 401  # the key first
    missing = anthropic.Anthropic(base_url=scripted.url, max_retries=0, api_key=None,
                                  default_headers={"x-api-key": KEY})
    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens left out (the client insists on it)
        missing.post("/v1/messages", body={"model": "scripted", "messages": ASK}, cast_to=object)
    assert e.value.body["error"]["message"] == "max_tokens: field required"
    assert missing.messages.create(model="scripted", max_tokens=3, messages=ASK).usage.output_tokens == 3
    wrong = anthropic.Anthropic(base_url=scripted.url, max_retries=0, api_key=None,
                                default_headers={"x-api-key": "sk-wrong"})
    for call in (lambda: wrong.messages.create(model="scripted", max_tokens=3, messages=ASK),
                 lambda: wrong.messages.count_tokens(model="scripted", messages=ASK),
                 lambda: client(scripted, api_key="sk-wrong").messages.create(model="scripted", max_tokens=3,
                                                                               messages=ASK)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            call()
        assert e.value.body["error"]["type"] == "authentication_error"
    wait_idle(scripted)


# ---- the default model held to a tool by tool_choice, then its result continued ----

@pytest.fixture(scope="module")
def smol(default_llm):
    st = ServerThread(default_llm, "smol")
    yield st
    st.stop()


def test_tool_round_trip_on_the_default_model(smol):
    c = anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0)
    r = c.messages.create(model="smol", max_tokens=60, messages=ASK, tools=[WEATHER], extra_body={"temperature": 0},
                          tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    follow = [*ASK, {"role": "assistant", "content": r.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    with c.messages.stream(model="smol", max_tokens=30, messages=follow, tools=[WEATHER], extra_body={"temperature": 0},
                           tool_choice={"type": "none"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == c.messages.count_tokens(
        model="smol", messages=follow, tools=[WEATHER], tool_choice={"type": "none"}).input_tokens
    wait_idle(smol)
