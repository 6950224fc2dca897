"""tool_choice auto in each format beyond Hermes, end to end: a model whose chat template renders the tools in
Llama 3.x's, Mistral's or Qwen3-Coder's way and whose output is scripted in that format (a fake runner over a byte
tokenizer), served with --enable-auto-tool-choice and queried through the official `openai` client, whole and
streamed: the same tool calls both ways."""
import openai
import pytest
from tokenizers import AddedToken

from jaxserve.openai.tool_parsers import tags_are_special
from jaxserve.server.served_model import AutoTools
from jaxserve.tokenizer import Tokenizer

from fake_runner import ScriptedRunner, fake_llm
from hf_models import save_byte_tokenizer_with_eos
from serving import ServerThread, wait_idle
from tool_call_checks import ASK, TOOLS, GetTime, GetWeather

# Each template renders the tools and past calls as its model family's does (shortened), spelling out what the
# server recognises the format by.
LLAMA3 = """{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if loop.last and tools %}Given the following functions, please respond with a JSON for a function call.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% for c in m.tool_calls or [] %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}{{ m.content or '' }}<|eot_id|>{% endfor %}\
<|start_header_id|>assistant<|end_header_id|>

"""
MISTRAL = """{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}\
{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}\
</s>{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"""
QWEN3_CODER = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}
<function><name>{{ t.function.name }}</name>{{ t.function.parameters | tojson }}</function>{% endfor %}
</tools>
To call a function reply: <tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""

SCRIPTS = {
    "llama3_json": (LLAMA3, None, '<|python_tag|>{"name": "GetWeather", "parameters": {"city": "Paris", "days": 2}}; '
                                  '{"name": "GetTime", "parameters": {"zone": "CET"}}'),
    "mistral": (MISTRAL, "Let me check.", 'Let me check.[TOOL_CALLS]GetWeather[ARGS]{"city": "Paris", "days": 2}'
                                          '[TOOL_CALLS]GetTime[ARGS]{"zone": "CET"}'),
    "qwen3_coder": (QWEN3_CODER, "Let me check.", "Let me check.\n<tool_call>\n<function=GetWeather>\n"
                    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=GetTime>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
                    "</tool_call>"),
}


def byte_tokenizer(path, template: str, special: tuple[str, ...] = ()) -> Tokenizer:
    """The byte-level test tokenizer (its EOS id 319), with these tags as special tokens."""
    save_byte_tokenizer_with_eos(path)
    tok = Tokenizer.from_hf_dir(path)
    if special:
        inner = tok._tok
        inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        tok = Tokenizer(inner, bos_token_id=None, eos_token_ids=tok.eos_token_ids, add_bos=False, chat_template=None)
    tok.chat_template = template
    return tok


def served(tok: Tokenizer, text: str, auto_tools: AutoTools) -> tuple[ServerThread, ScriptedRunner]:
    runner = ScriptedRunner(tok.encode(text, add_special_tokens=False), tok.eos_token_ids[0], tok.vocab_size)
    llm = fake_llm(vocab_size=tok.vocab_size, max_model_len=2048, tokenizer=tok, num_pages=1024,
                   max_num_batched_tokens=256, runner=runner)
    return ServerThread(llm, "scripted", auto_tools=auto_tools), runner


def check_calls(st: ServerThread, content):
    """Whole (auto by default, and named), and streamed: the same two calls and content."""
    c = openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
    whole = [c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, **extra).choices[0]
             for extra in ({}, {"tool_choice": "auto"})]
    with c.chat.completions.stream(model="scripted", messages=ASK, tools=TOOLS, tool_choice="auto") as stream:
        streamed = stream.get_final_completion().choices[0]
    chunks = list(c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True))
    firsts = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or [] if t.id]
    assert [(t.index, t.function.name, t.function.arguments) for t in firsts] == [(0, "GetWeather", ""),
                                                                                 (1, "GetTime", "")]
    assert (("".join(ch.choices[0].delta.content or "" for ch in chunks)) or None) == content
    for choice in whole + [streamed]:
        # (a stream's first chunk opens the message with content "", as OpenAI's)
        assert choice.finish_reason == "tool_calls" and (choice.message.content or None) == content
        calls = choice.message.tool_calls
        assert [t.function.name for t in calls] == ["GetWeather", "GetTime"]
        assert GetWeather.model_validate_json(calls[0].function.arguments) == GetWeather(city="Paris", days=2)
        assert GetTime.model_validate_json(calls[1].function.arguments) == GetTime(zone="CET")
        assert [t.function.arguments for t in calls] == [t.function.arguments for t in whole[0].message.tool_calls]
    assert [t.function.parsed_arguments for t in streamed.message.tool_calls] == [GetWeather(city="Paris", days=2),
                                                                                 GetTime(zone="CET")]
    wait_idle(st)


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("named", [False, True], ids=["detected", "named"])
def test_auto_tool_calls_in_each_format(tmp_path, name, named):
    """The parser the template implies (no --tool-call-parser), or the one named; the tools reached the prompt."""
    template, content, script = SCRIPTS[name]
    tok = byte_tokenizer(tmp_path, template)
    st, runner = served(tok, script, AutoTools(name if named else None, enabled=True))
    try:
        check_calls(st, content)
        seen = "".join(tok.decode(list(row.token_ids)) for step in runner.steps for row in step)  # prompt chunks
        assert '"GetWeather"' in seen or ">GetWeather<" in seen
    finally:
        st.stop()


def test_mistral_tags_that_are_special_tokens(tmp_path):
    """[TOOL_CALLS] and [ARGS] are control tokens of Mistral's vocabularies, which decoding drops: the server keeps
    them in an auto request's text, as vLLM's mistral parser asks."""
    template, content, script = SCRIPTS["mistral"]
    tok = byte_tokenizer(tmp_path, template, special=("[TOOL_CALLS]", "[ARGS]"))
    assert tags_are_special(tok, ("[TOOL_CALLS]",)) and tok.vocab_size == 322
    st, _ = served(tok, script, AutoTools("mistral", enabled=True))
    try:
        check_calls(st, content)
    finally:
        st.stop()


def test_a_named_parser_that_does_not_match_the_output_gives_content(tmp_path):
    """A malformed call (here: the model writes Hermes, the server reads Llama JSON) is content, whole and
    streamed, never an error."""
    text = '<tool_call>{"name": "GetTime", "arguments": {"zone": "CET"}}</tool_call>'
    st, _ = served(byte_tokenizer(tmp_path, LLAMA3), text, AutoTools("llama3_json", enabled=True))
    try:
        c = openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        chunks = list(c.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
        wait_idle(st)
    finally:
        st.stop()
