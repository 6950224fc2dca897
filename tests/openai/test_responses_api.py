"""POST/GET /v1/responses through the official `openai` client, unmodified, against a server whose model writes
what each test needs (a scripted fake over a byte tokenizer, behind a Hermes tool-call template): output items
whole and streamed (typed events with their sequence numbers, and the client's stream helper), tool calls and a
function_call_output continuing them, json_schema through responses.parse, previous_response_id and the store, usage
with the prefix cache's hits, reasoning items through the real reasoning parser (--reasoning-parser qwen3, a tool
call held to its grammar after the reasoning), and
every unsupported field a 400 naming it; the Agents SDK's streamed run reading the events."""
import asyncio
import json

import openai
import pydantic
import pytest

from jaxserve.server.served_model import AutoTools
from jaxserve.tokenizer import Tokenizer

from fake_runner import ScriptedRunner, fake_llm
from locations import DATA
from serving import ServerThread, http, wait_idle

TEMPLATE = (DATA / "hermes_tools_template.jinja").read_text()


class GetWeather(pydantic.BaseModel):
    city: str
    days: int


WEATHER_TOOL = {"type": "function", "name": "GetWeather", "description": "The weather in a city",
                "parameters": GetWeather.model_json_schema(), "strict": False}
CALL = '{"name": "GetWeather", "arguments": {"city": "Paris", "days": 2}}'
SCRIPT = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"


def scripted_server(tiny_tokenized_dir, **server_args) -> ServerThread:
    """A server whose model writes `runner.script` (then EOS) whatever it is asked; tests set the script
    (st.script(text)). tool_choice auto served, as the Responses API's default with tools."""
    tokenizer = Tokenizer.from_hf_dir(tiny_tokenized_dir)
    tokenizer.chat_template = TEMPLATE
    runner = ScriptedRunner([], tokenizer.eos_token_ids[0], tokenizer.vocab_size)
    llm = fake_llm(vocab_size=tokenizer.vocab_size, max_model_len=4096, tokenizer=tokenizer, num_pages=2048,
                   max_num_batched_tokens=512, runner=runner)
    st = ServerThread(llm, "scripted", responses_store_size=4, auto_tools=AutoTools(enabled=True), **server_args)
    st.script = lambda text: setattr(runner, "script", tokenizer.encode(text, add_special_tokens=False))
    return st


@pytest.fixture(scope="module")
def scripted(tiny_tokenized_dir):
    st = scripted_server(tiny_tokenized_dir)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def thinker(tiny_tokenized_dir):
    """The same served with --reasoning-parser qwen3."""
    st = scripted_server(tiny_tokenized_dir, reasoning_parser="qwen3")
    yield st
    st.stop()


def client(st):
    return openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)


def test_text_whole_streamed_and_stored(scripted):
    scripted.script("Hello there.")
    c = client(scripted)
    r = c.responses.create(model="scripted", input="Hi!", instructions="Be brief.", temperature=0, metadata={"k": "v"})
    assert r.status == "completed" and r.output_text == "Hello there." and r.object == "response"
    assert [(o.type, o.role, o.status) for o in r.output] == [("message", "assistant", "completed")]
    assert r.id.startswith("resp_") and r.instructions == "Be brief." and r.metadata == {"k": "v"}
    u = r.usage
    assert u.output_tokens == len("Hello there.") + 1 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    # GET: the stored response, as it was answered.
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    # Streamed: the typed events in OpenAI's order, numbered from 0, building the same text.
    events = list(c.responses.create(model="scripted", input="Hi!", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    assert events[-1].response.output_text == "Hello there."
    # The client's stream helper.
    with c.responses.stream(model="scripted", input="Hi!") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there."
    wait_idle(scripted)


def test_tool_call_and_its_output_continued(scripted):
    scripted.script(SCRIPT)
    c = client(scripted)
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris for 2 days?"}]}]
    r = c.responses.create(model="scripted", input=ask, tools=[WEATHER_TOOL])
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "GetWeather" and call.call_id.startswith("call_")
    assert GetWeather.model_validate_json(call.arguments) == GetWeather(city="Paris", days=2)
    # The same streamed: the call's arguments as deltas, then done with the whole.
    events = list(c.responses.create(model="scripted", input=ask, tools=[WEATHER_TOOL], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris", "days": 2}
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        done[0].arguments
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]
    # The tool's result continues the conversation: by previous_response_id, and by sending the items back.
    scripted.script("It is sunny.")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = c.responses.create(model="scripted", input=[result], previous_response_id=r.id, tools=[WEATHER_TOOL])
    assert chained.output_text == "It is sunny." and chained.previous_response_id == r.id
    # The conversation so far is a prefix of the new prompt: its pages come from the prefix cache.
    assert chained.usage.input_tokens > r.usage.input_tokens and chained.usage.input_tokens_details.cached_tokens > 0
    items = ask + [o.model_dump(exclude_none=True) for o in r.output] + [result]
    resent = c.responses.create(model="scripted", input=items, tools=[WEATHER_TOOL], store=False)
    assert resent.usage.input_tokens == chained.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # not stored
        c.responses.retrieve(resent.id)
    wait_idle(scripted)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "GetWeather"}])
def test_enforced_tool_choice(scripted, tool_choice):
    """required (a JSON array of calls) and a named function (its arguments), as the chat path enforces them."""
    scripted.script(f"[{CALL}]" if tool_choice == "required" else '{"city": "Paris", "days": 2}')
    r = client(scripted).responses.create(model="scripted", input="Weather?", tools=[WEATHER_TOOL],
                                          tool_choice=tool_choice)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", "GetWeather", {"city": "Paris", "days": 2})]
    assert r.tool_choice == tool_choice or r.tool_choice.name == "GetWeather"
    wait_idle(scripted)


def test_parse_json_schema(scripted):
    scripted.script('{"city": "Paris", "days": 2}')
    c = client(scripted)
    r = c.responses.parse(model="scripted", input="Weather as JSON", text_format=GetWeather)
    assert r.output_parsed == GetWeather(city="Paris", days=2)
    assert r.text.format.type == "json_schema"
    r = c.responses.create(model="scripted", input="JSON", text={"format": {"type": "json_object"}})
    assert json.loads(r.output_text) == {"city": "Paris", "days": 2}
    wait_idle(scripted)


def test_max_output_tokens_is_incomplete(scripted):
    scripted.script("Hello there.")
    c = client(scripted)
    r = c.responses.create(model="scripted", input="Hi!", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hel" and r.usage.output_tokens == 3
    events = list(c.responses.create(model="scripted", input="Hi!", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    wait_idle(scripted)


def test_reasoning_items_through_the_reasoning_parser(thinker):
    thinker.script("<think>Paris is in France.</think>It is sunny.")
    c = client(thinker)
    r = c.responses.create(model="scripted", input="Weather?")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is in France."
    assert message.content[0].text == "It is sunny." and r.output_text == "It is sunny."
    assert r.usage.output_tokens_details.reasoning_tokens == len("Paris is in France.")
    events = list(c.responses.create(model="scripted", input="Weather?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Paris is in France."
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    assert not any("think>" in getattr(e, "delta", "") for e in events)
    # Continued: the earlier reasoning is not rendered again (the answer is), as templates drop it.
    thinker.script("<think>Still sunny.</think>Yes.")
    nxt = c.responses.create(model="scripted", input="Sure?", previous_response_id=r.id)
    assert nxt.output_text == "Yes."
    text = "<|im_start|>assistant\nIt is sunny.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n"
    assert nxt.usage.input_tokens == r.usage.input_tokens + len(text)
    wait_idle(thinker)


@pytest.mark.parametrize("tool_choice, answer", [
    ("auto", f"<tool_call>\n{CALL}\n</tool_call>"), ("required", f"[{CALL}]"),
    ({"type": "function", "name": "GetWeather"}, '{"city": "Paris", "days": 2}')])
def test_reasoning_then_a_tool_call(thinker, tool_choice, answer):
    """The call is read from the answer after </think> (auto: a <tool_call> in the reasoning is reasoning text), and
    an enforced one held to its grammar from there (the reasoning, no JSON, is free)."""
    thought = "A <tool_call> {city: Paris, now.\n"
    thinker.script(f"<think>{thought}</think>{answer}")
    r = client(thinker).responses.create(model="scripted", input="Weather?", tools=[WEATHER_TOOL],
                                         tool_choice=tool_choice)
    assert [o.type for o in r.output] == ["reasoning", "function_call"], r.output
    assert r.output[0].content[0].text == thought and r.status == "completed"
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("GetWeather", {"city": "Paris", "days": 2})
    wait_idle(thinker)


def test_store_is_bounded_and_unknown_ids_are_404(scripted):
    scripted.script("ok")
    c = client(scripted)
    ids = [c.responses.create(model="scripted", input=f"Hi {k}").id for k in range(5)]
    with pytest.raises(openai.NotFoundError) as e:  # the oldest of 5 went (the store keeps 4)
        c.responses.retrieve(ids[0])
    assert e.value.body["code"] == "response_not_found"
    assert c.responses.retrieve(ids[4]).id == ids[4]
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="scripted", input="more", previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id"
    wait_idle(scripted)


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(a"}}}},
     "text"),  # a grammar that does not compile
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_output_tokens": "ten"}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, None),  # past the context: the chat path's context-length 400
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": 3, "output": "x"}]}, "input"),
])
def test_unsupported_and_bad_fields_are_400_naming_them(scripted, fields, param):
    status, raw = http("POST", scripted.url + "/v1/responses", {"model": "scripted", "input": "Hi", **fields})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
    wait_idle(scripted)


def test_store_size_zero_keeps_none_and_a_negative_flag_is_refused(tiny_dir):
    from jaxserve.cli import main
    from jaxserve.openai.responses_store import ResponseStore
    store = ResponseStore(0)
    store.put({"id": "resp_1"}, [])
    assert len(store) == 0
    assert main(["serve", "--model", tiny_dir, "--responses-store-size", "-1"]) == 1


def test_agents_sdk_streamed_run_reads_the_events(scripted):
    """The Agents SDK's streamed run over this server's events: the model's call runs the tool, whose result ends
    the run (stop_on_first_tool: the scripted model would call it again forever)."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    scripted.script(SCRIPT)

    @function_tool
    def GetWeather(city: str, days: int) -> str:  # noqa: N802 - the scripted model's tool name
        """The weather in a city."""
        return f"sunny in {city} for {days} days"

    model = OpenAIResponsesModel(model="scripted", openai_client=openai.AsyncOpenAI(
        base_url=scripted.url + "/v1", api_key="unused", max_retries=0))
    agent = Agent(name="weather", tools=[GetWeather], model=model, tool_use_behavior="stop_on_first_tool")

    async def run():
        result = Runner.run_streamed(agent, "Weather in Paris for 2 days?")
        kinds = [e.type async for e in result.stream_events()]
        return result, kinds
    result, kinds = asyncio.run(run())
    assert result.final_output == "sunny in Paris for 2 days"
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    wait_idle(scripted)
