"""The tool-call parsers that tool_choice auto may use, by vLLM's `--tool-call-parser` names, and the one a chat
template's own tool-call format implies where no parser is named.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes)
- llama3_json: `<|python_tag|>{"name": ..., "parameters": {...}}; {...}` (Llama 3.1, 3.2, 3.3)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` from tokenizer v11 on
  (Mistral 7B v0.3, Mistral Nemo / Small)
- qwen3_coder: `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` (Qwen3-Coder)

Each is `cls(functions, parallel)` with `feed(text) -> deltas`, `finish() -> deltas`, `calls` and `TAGS` (its markers,
kept in the text where they are special tokens); see jaxserve.openai.tool_parsers.
"""
from __future__ import annotations

from jaxserve.openai.tool_json_formats import ARGS, PYTHON_TAG, TOOL_CALLS, Llama3JsonCalls, MistralCalls
from jaxserve.openai.tool_parsers import HERMES_START, HermesCalls
from jaxserve.openai.tool_xml_format import Qwen3CoderCalls

TOOL_PARSERS: dict[str, type] = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls, "mistral": MistralCalls,
                                 "qwen3_coder": Qwen3CoderCalls}

# What a template that writes each format spells out, most specific first (Qwen3-Coder's also has <tool_call>).
_SIGNS = [("qwen3_coder", ("<function=", "<parameter=")), ("hermes", (HERMES_START,)), ("mistral", (TOOL_CALLS,)),
          ("mistral", (ARGS,)), ("llama3_json", (PYTHON_TAG,)),
          ("llama3_json", ('"parameters": dictionary of argument name',))]


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format implies (None: none recognised)."""
    if chat_template is None:
        return None
    return next((name for name, signs in _SIGNS if all(s in chat_template for s in signs)), None)


def tool_parser_class(name: str | None, chat_template: str | None) -> type | None:
    """The parser named (--tool-call-parser), else the template's. A name that is none of them is a ValueError."""
    if name is None:
        name = detect_tool_parser(chat_template)
        return None if name is None else TOOL_PARSERS[name]
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]
