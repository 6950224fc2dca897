"""Reasoning in chat completions (--reasoning-parser), through the official `openai` client against the server: a
scripted model (tokens written by hand, the tiny byte-level tokenizer, so each tag is several tokens) under chat
templates that open the block in the prompt (DeepSeek-R1's) or let the model open it (Qwen3's, with
enable_thinking). Whole answers carry message.reasoning_content and the answer apart; streams send the reasoning
as delta.reasoning_content before the answer's deltas, concatenating to the same; a json_schema holds the answer
only."""
import json

import openai
import pydantic
import pytest

from jaxserve.server.served_model import AutoTools
from jaxserve.tokenizer import Tokenizer

from fake_runner import ScriptedRunner, fake_llm
from serving import ServerThread, http, wait_idle

# ChatML, then DeepSeek-R1's opening of the block in the prompt, or Qwen3's (the model opens it; enable_thinking
# false: an empty block in the prompt).
CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n")
TEMPLATES = {"deepseek_r1": CHATML + "<think>\n{% endif %}",
             "qwen3": CHATML + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                               "{% endif %}{% endif %}"}
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


class Answer(pydantic.BaseModel):
    a: int


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenized_dir):
    return Tokenizer.from_hf_dir(tiny_tokenized_dir)


@pytest.fixture
def serve(tokenizer):
    """serve(parser, script) -> a server whose model writes `script` (then EOS) under the parser's template (tool_choice
    auto served)."""
    started = []

    def start(parser: str | None, script: str, template: str | None = None) -> ServerThread:
        tokenizer.chat_template = template or TEMPLATES[parser or "deepseek_r1"]
        eos = tokenizer.eos_token_ids[0]
        runner = ScriptedRunner(tokenizer.encode(script, add_special_tokens=False), eos, tokenizer.vocab_size)
        llm = fake_llm(vocab_size=tokenizer.vocab_size, max_model_len=1024, tokenizer=tokenizer, num_pages=512,
                       max_num_batched_tokens=64, runner=runner)
        started.append(ServerThread(llm, "thinker", reasoning_parser=parser, auto_tools=AutoTools(enabled=True)))
        return started[-1]
    yield start
    for st in started:
        st.stop()


def client(st):
    return openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)


def streamed(st, **kw) -> tuple[list[tuple[str, str]], dict]:
    """The stream's deltas in order, as (kind, text), and its usage."""
    pieces, usage = [], None
    for chunk in client(st).chat.completions.create(model="thinker", messages=ASK, stream=True,
                                                     stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]  # vLLM's newer name, the same text
                pieces.append(("reasoning", extra["reasoning_content"]))
            if choice.delta.content:
                pieces.append(("content", choice.delta.content))
    return pieces, usage


def joined(pieces, kind) -> str:
    return "".join(text for k, text in pieces if k == kind)


THOUGHT = "The user asks 2 + 2. That is 4; say it plainly.\n"
SCRIPT = THOUGHT + "</think>\n\nIt is 4."


def test_deepseek_r1_whole_and_streamed(serve, tokenizer):
    st = serve("deepseek_r1", SCRIPT)
    r = client(st).chat.completions.create(model="thinker", messages=ASK)
    message = r.choices[0].message
    assert message.content == "\n\nIt is 4." and message.model_extra["reasoning_content"] == THOUGHT
    assert message.model_extra["reasoning"] == THOUGHT and r.choices[0].finish_reason == "stop"
    # usage counts every token generated, the reasoning's too (and the EOS that ended it)
    assert r.usage.completion_tokens == len(tokenizer.encode(SCRIPT, add_special_tokens=False)) + 1
    pieces, usage = streamed(st)
    kinds = [k for k, _ in pieces]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index), pieces  # reasoning first, then the answer
    assert joined(pieces, "reasoning") == THOUGHT and joined(pieces, "content") == "\n\nIt is 4."
    assert len(pieces) > 2 and usage.completion_tokens == r.usage.completion_tokens
    assert not any("think>" in text for _, text in pieces)
    wait_idle(st)


def test_without_a_parser_the_text_is_as_written(serve):
    st = serve(None, SCRIPT)
    message = client(st).chat.completions.create(model="thinker", messages=ASK).choices[0].message
    assert message.content == SCRIPT and "reasoning_content" not in (message.model_extra or {})
    wait_idle(st)


def test_json_schema_holds_the_answer_after_free_reasoning(serve):
    """The reasoning is text no JSON grammar takes ("{a: int}", an unclosed brace); the answer follows the schema,
    whole (parse()) and streamed. Without the parser the same grammar refuses the first token: finish "error"."""
    thought = "Schema says {a: int, so answer { \"a\": 4 }.\n"
    st = serve("deepseek_r1", thought + '</think>{"a": 4} trailing text the grammar refuses')
    c = client(st)
    parsed = c.chat.completions.parse(model="thinker", messages=ASK, response_format=Answer)
    choice = parsed.choices[0]
    assert choice.message.parsed == Answer(a=4) and choice.message.model_extra["reasoning_content"] == thought
    assert choice.finish_reason == "stop"
    pieces, _ = streamed(st, response_format={"type": "json_schema", "json_schema": {
        "name": "Answer", "schema": Answer.model_json_schema()}})
    assert joined(pieces, "reasoning") == thought and json.loads(joined(pieces, "content")) == {"a": 4}
    wait_idle(st)
    plain = serve(None, thought + '</think>{"a": 4}')
    r = client(plain).chat.completions.create(model="thinker", messages=ASK,
                                              response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "error" and r.choices[0].message.content == ""
    wait_idle(plain)


def test_qwen3_thinks_only_when_it_opens_the_block(serve):
    """Qwen3's template: the model opens the block itself; with enable_thinking false (chat_template_kwargs) the
    prompt holds an empty block, so the grammar starts with the output. (The grammar holds from the token after
    the tag: JSON's allows no leading whitespace, so a model under its mask answers without Qwen3's usual "\n\n".)"""
    st = serve("qwen3", '<think>\nJSON with a = 4. {oops\n</think>{"a": 4}')
    c = client(st)
    r = c.chat.completions.parse(model="thinker", messages=ASK, response_format=Answer)
    assert r.choices[0].message.parsed == Answer(a=4)
    assert r.choices[0].message.model_extra["reasoning_content"] == "\nJSON with a = 4. {oops\n"
    wait_idle(st)
    direct = serve("qwen3", '{"a": 4}')
    r = client(direct).chat.completions.parse(model="thinker", messages=ASK, response_format=Answer,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.parsed == Answer(a=4) and r.choices[0].message.model_extra["reasoning_content"] is None
    wait_idle(direct)


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"not a name": 1},
                                    {"x": "\ud800"}, []])
def test_bad_chat_template_kwargs_are_a_400(serve, kwargs):
    st = serve("qwen3", "hi")
    body = {"model": "thinker", "messages": ASK, "chat_template_kwargs": kwargs}
    status, raw = http("POST", st.url + "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "chat_template_kwargs", raw


def test_an_unknown_parser_or_a_role_server_is_refused(tokenizer):
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        ServerThread(fake_llm(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer), "x", reasoning_parser="r2")
    # A decode server never sees the first token's text (the prefill server's): the split would start mid-tag.
    with pytest.raises(ValueError, match="disaggregated prefill"):
        ServerThread(fake_llm(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, role="decode"), "x",
                     reasoning_parser="qwen3")


def test_tool_calls_are_parsed_from_the_answer_only(serve):
    """A <tool_call> written while reasoning is reasoning text; the one after </think> is the call."""
    from locations import DATA
    thought = "I could write <tool_call> here, but not yet.\n"
    call = '<tool_call>\n{"name": "Answer", "arguments": {"a": 4}}\n</tool_call>'
    st = serve("deepseek_r1", thought + "</think>" + call, (DATA / "hermes_tools_template.jinja").read_text())
    tools = [openai.pydantic_function_tool(Answer)]
    r = client(st).chat.completions.create(model="thinker", messages=ASK, tools=tools)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == thought and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [("Answer", {"a": 4})]
    with client(st).chat.completions.stream(model="thinker", messages=ASK, tools=tools) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Answer(a=4)
    wait_idle(st)


def test_serve_takes_the_flag(tiny_tokenized_dir, monkeypatch, capsys):
    """`jaxserve serve --reasoning-parser NAME` reaches every served model; an unknown name is a one-line exit."""
    import jaxserve.server
    from jaxserve.cli import main
    from jaxserve.openai.reasoning import DeepSeekR1ReasoningParser
    seen = {}

    async def fake_serve(server, host, port, grace_period_s=30.0, ready=None):
        seen.update({name: m.reasoning_parser for name, m in server.models.items()})
        for engine in server.engines():
            engine.shutdown(30)
    monkeypatch.setattr(jaxserve.server, "serve", fake_serve)
    assert main(["serve", "--model", tiny_tokenized_dir, "--served-model-name", "r1", "--reasoning-parser",
                 "deepseek_r1", "--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                 "--block-size", "4", "--no-warmup"]) == 0
    assert seen == {"r1": DeepSeekR1ReasoningParser}
    with pytest.raises(SystemExit):
        main(["serve", "--reasoning-parser", "r2"])
    assert "invalid choice: 'r2'" in capsys.readouterr().err


def test_a_named_call_streams_after_the_reasoning(serve):
    """tool_choice naming a function: its grammar holds the answer after </think>, and its call's first delta (the
    name) comes after the reasoning's last, not with the first token (as it does without reasoning)."""
    thought = "Which a? {a: int\n"
    st = serve("deepseek_r1", thought + '</think>{"a": 4}')
    order = []
    for chunk in client(st).chat.completions.create(
            model="thinker", messages=ASK, stream=True, tools=[openai.pydantic_function_tool(Answer)],
            tool_choice={"type": "function", "function": {"name": "Answer"}}):
        for choice in chunk.choices:
            if (choice.delta.model_extra or {}).get("reasoning_content"):
                order.append(("reasoning", choice.delta.model_extra["reasoning_content"]))
            for call in choice.delta.tool_calls or []:
                order.append(("call", call.function.arguments or call.function.name or ""))
    kinds = [k for k, _ in order]
    assert kinds == sorted(kinds, key=["reasoning", "call"].index), order
    assert joined(order, "reasoning") == thought and json.loads(joined(order, "call")[len("Answer"):]) == {"a": 4}
    wait_idle(st)
