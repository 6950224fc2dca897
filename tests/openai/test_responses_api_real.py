"""The Responses API on the default model (SmolLM2-135M-Instruct) through the official clients, unmodified: the
`openai` client's responses.create (whole and streamed), responses.parse with a pydantic model, previous_response_id
and GET; a tool round trip; and the OpenAI Agents SDK running one agent with one function tool to completion.

SmolLM2's own template renders neither tools nor an assistant turn of tool calls, so the tool tests serve it behind
a Hermes tool-call template (as the chat tool tests do): the first turn's call is enforced (tool_choice required),
the turn after the tool's result is free (auto, parsed as Hermes)."""
import contextlib
import json

import openai
import pydantic
import pytest

from jaxserve.server.served_model import AutoTools

from locations import DATA
from serving import ServerThread, wait_idle

TEMPLATE = (DATA / "hermes_tools_template.jinja").read_text()


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=150)


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    days: int = pydantic.Field(ge=1, le=14)


FORECAST = {"type": "function", "name": "Forecast", "description": "The weather forecast for a city",
            "parameters": {**Forecast.model_json_schema(), "additionalProperties": False}, "strict": True}


@pytest.fixture(scope="module")
def smol(default_llm):
    st = ServerThread(default_llm, "smol", auto_tools=AutoTools(enabled=True))  # (the Agents SDK's second turn)
    yield st
    st.stop()


@contextlib.contextmanager
def hermes_template(st):
    tokenizer = st.server.models["smol"].tokenizer
    own, tokenizer.chat_template = tokenizer.chat_template, TEMPLATE
    try:
        yield
    finally:
        tokenizer.chat_template = own


def client(st):
    return openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)


def test_create_streamed_parse_chain_and_get(smol):
    c = client(smol)
    args = dict(model="smol", input="What is the capital of France?", temperature=0, max_output_tokens=24)
    r = c.responses.create(**args)
    assert r.output_text and r.status in ("completed", "incomplete")
    with c.responses.stream(**args) as stream:  # greedy: the same text, streamed
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    assert c.responses.retrieve(r.id).output_text == r.output_text
    # Chained: the earlier turn is in the prompt, its pages from the prefix cache.
    nxt = c.responses.create(model="smol", input="And of Italy?", previous_response_id=r.id, temperature=0,
                             max_output_tokens=24)
    assert nxt.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    parsed = c.responses.parse(model="smol", input="Describe a person as JSON: name and age.", text_format=Person,
                               temperature=0, max_output_tokens=100)
    assert isinstance(parsed.output_parsed, Person), parsed.output_text
    wait_idle(smol)


def test_tool_round_trip(smol):
    c = client(smol)
    with hermes_template(smol):
        r = c.responses.create(model="smol", input="What is the weather in Paris for the next 3 days?",
                               tools=[FORECAST], tool_choice="required", parallel_tool_calls=False, temperature=0,
                               max_output_tokens=80)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "Forecast", r.output
        Forecast.model_validate_json(calls[0].arguments)
        done = c.responses.create(model="smol", previous_response_id=r.id, tools=[FORECAST], temperature=0,
                                  max_output_tokens=40, tool_choice="none", input=[
                                      {"type": "function_call_output", "call_id": calls[0].call_id,
                                       "output": json.dumps({"forecast": "sunny, 21 C"})}])
        assert done.output[0].type == "message" and done.output_text
    wait_idle(smol)


def test_agents_sdk_runs_an_agent_with_a_function_tool(smol):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(model="smol", openai_client=openai.AsyncOpenAI(
        base_url=smol.url + "/v1", api_key="unused", max_retries=0))
    # The first turn must call the tool; after it the SDK resets tool_choice (auto) and the model answers.
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    with hermes_template(smol):
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert asked and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    wait_idle(smol)
