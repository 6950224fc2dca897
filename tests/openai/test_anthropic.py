"""Anthropic's Messages API without a server: a body turned into the chat body it means (and what is refused), the
chat path's deltas turned into content blocks and stream events, with and without reasoning split off by the real
reasoning parser."""
import json

import pytest

from jaxserve.openai.anthropic import chat_body, error_body
from jaxserve.openai.anthropic_output import MessageBuilder, stop_reason, usage
from jaxserve.openai.errors import ApiError
from jaxserve.openai.reasoning import Qwen3ReasoningParser, reasoning_fields, split_whole

WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_conversation_becomes_the_chat_body_it_means():
    body = {"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "Be "}, {"type": "text",
                                                                                       "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}],
                     "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": True,
            "metadata": {"user_id": "u"}}
    chat, thinking = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                               "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert {k: chat[k] for k in ("model", "max_tokens", "stop", "temperature", "top_p", "top_k", "stream")} == {
        "model": "m", "max_tokens": 50, "stop": ["\n\n"], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "stream": True}
    assert not thinking.shown
    named, _ = chat_body({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_body({**body, "tool_choice": {"type": "none"}})[0]["tool_choice"] == "none"
    # count_tokens: the same conversation, no sampling fields
    counted, _ = chat_body({k: body[k] for k in ("model", "system", "messages", "tools")}, count_only=True)
    assert counted["messages"] == chat["messages"] and "max_tokens" not in counted


@pytest.mark.parametrize("change, field, words", [
    ({"max_tokens": None}, "max_tokens", "required"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"container": "c"}, "container", "unknown field"),
    ({"mcp_servers": []}, "mcp_servers", "unknown field"),
    ({"temperature": 1.5}, "temperature", "[0, 1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages", "image blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{}]}]}]}, "messages",
     "citations"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document"}]}]}]}, "messages", "document blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages", "tool_use"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "role"),
    ({"system": [{"type": "image"}]}, "system", "image"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools", "custom tools"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools", "strict"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice"),
    ({"tool_choice": {"type": "auto"}}, "tool_choice", "needs tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking", "1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking", "less than max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, "thinking", "summarized"),
    ({"stream": "yes"}, "stream", "must be a boolean"),
])
def test_what_is_refused_is_a_400_naming_it(change, field, words):
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(ApiError) as e:
        chat_body({k: v for k, v in body.items() if v is not None})
    assert e.value.status == 400 and e.value.param == field and words in e.value.message, e.value.message
    assert error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": e.value.message}}


def test_error_types_follow_the_status():
    assert [error_body(ApiError(s, "x"))["error"]["type"] for s in (401, 404, 413, 429, 500, 503)] == [
        "authentication_error", "not_found_error", "request_too_large", "rate_limit_error", "api_error",
        "overloaded_error"]


def events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in data.decode().split("\n\n"):
        if chunk:
            name, payload = chunk.split("\n")
            assert name.startswith("event: ") and payload.startswith("data: ")
            out.append((name[len("event: "):], json.loads(payload[len("data: "):])))
    return out


CALL = [{"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]


def test_chat_deltas_become_blocks_and_their_events():
    b = MessageBuilder()
    data = b"".join(b.feed(d) for d in [{"content": "Let "}, {}, {"content": "me."}, *CALL]) + b.finish()
    assert b.content() == [{"type": "text", "text": "Let me."},
                           {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}}]
    got = events(data)
    assert [(name, e.get("index"), e.get("delta", {}).get("type")) for name, e in got] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None)]
    assert got[4][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    # arguments cut short (max_tokens): no input can be read from them
    cut = MessageBuilder()
    cut.feed(CALL[0]), cut.feed(CALL[1]), cut.finish()
    assert cut.content()[0]["input"] == {}


def reasoned(pieces: list[str]) -> list[dict]:
    """The chat deltas of these output pieces under --reasoning-parser qwen3, as the chat path makes them: each
    piece split by the parser (flushed at the last), its reasoning's delta before its answer's."""
    parser, deltas = Qwen3ReasoningParser(), []
    for k, piece in enumerate(pieces):
        thought, answer = split_whole(parser, piece) if k == len(pieces) - 1 else parser.feed(piece)
        deltas += [reasoning_fields(thought)] if thought else []
        deltas += [{"content": answer}] if answer else []
    return deltas


def test_reasoning_becomes_thinking_blocks_only_when_asked():
    pieces = reasoned(["<think>Two ", "steps.</thi", "nk>Paris", "."])
    shown = MessageBuilder(show_thinking=True)
    data = b"".join(shown.feed(d) for d in pieces) + shown.finish()
    assert shown.content() == [{"type": "thinking", "thinking": "Two steps.", "signature": ""},
                               {"type": "text", "text": "Paris."}]
    assert [e.get("delta", {}).get("type") for _, e in events(data)] == [
        None, "thinking_delta", "thinking_delta", None, None, "text_delta", "text_delta", None]
    hidden = MessageBuilder(show_thinking=False)
    data = b"".join(hidden.feed(d) for d in pieces) + hidden.finish()
    assert hidden.content() == [{"type": "text", "text": "Paris."}]
    assert "thinking" not in data.decode()
    # reasoning, then a tool call (the chat path parsed it from the answer only)
    called = MessageBuilder(show_thinking=True)
    for d in [*reasoned(["<think>Hmm.</think>"]), *CALL]:
        called.feed(d)
    called.finish()
    assert [b["type"] for b in called.content()] == ["thinking", "tool_use"]
    # a reasoning that never ended: all of it is reasoning
    unended = MessageBuilder(show_thinking=True)
    for d in reasoned(["<think>still ", "going"]):
        unended.feed(d)
    unended.finish()
    assert unended.content() == [{"type": "thinking", "thinking": "still going", "signature": ""}]


def test_stop_reasons_and_usage():
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", 2) == ("end_turn", None)  # the EOS token
    assert stop_reason("stop", "\n\n") == ("stop_sequence", "\n\n")
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert usage(10, 3, 4) == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                               "cache_creation_input_tokens": 0}
