"""Chat messages as the chat template gets them, checked; the prompt they render to."""
from __future__ import annotations

import json

from jaxserve.openai import structured as openai_structured
from jaxserve.openai.errors import ApiError, check_request_text
from jaxserve.openai.structured import FieldError
from jaxserve.openai.tool_calls import ToolRequest


def parse_message(m, i: int) -> dict:
    """One message as a chat template gets it (as HF's apply_chat_template): text content parts joined, developer
    as system, an assistant's tool calls with their arguments as JSON values, not text."""
    if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "developer", "tool")):
        raise ApiError(400, f"messages[{i}] must be an object with a role (system, user, assistant, tool) and "
                            f"content", "messages")
    m = dict(m)
    if m["role"] == "developer":
        m["role"] = "system"
    if m["role"] == "assistant" and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"messages[{i}].tool_calls must be an array", "messages")
        m["tool_calls"] = [_past_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        if m.get("content") is None:  # a turn of tool calls only
            m.pop("content", None)
            return m
    elif "tool_calls" in m:
        if m["tool_calls"] not in (None, []):
            raise ApiError(400, f"messages[{i}]: only assistant messages have tool_calls", "messages")
        del m["tool_calls"]
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers", "messages")
    if not isinstance(m.get("content"), (str, list)):
        raise ApiError(400, f"messages[{i}] must have content (a string or text parts)", "messages")
    if isinstance(m["content"], list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in m["content"]):
            raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
        m["content"] = "".join(p["text"] for p in m["content"])
    check_request_text(m["content"], "messages", f"messages[{i}].content")
    return m


def _past_tool_call(call, where: str) -> dict:
    """A tool call of an earlier assistant turn: {id, type, function: {name, arguments}}, its arguments parsed."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and call.get("type", "function") == "function" and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)):
        raise ApiError(400, f"{where} must be {{id, type: function, function: {{name, arguments (JSON text)}}}}",
                       "messages")
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
        raise ApiError(400, f"{where}.function.arguments is not JSON text (or nested too deeply)", "messages") from None
    try:
        openai_structured.check_text(arguments, f"{where}.function.arguments")
    except FieldError as e:
        raise ApiError(400, str(e), "messages") from None
    return {**call, "type": "function", "function": {**fn, "arguments": arguments}}


# Template variables the server sets itself: a request's chat_template_kwargs may not replace them.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def chat_template_kwargs(body: dict) -> dict:
    """vLLM's chat_template_kwargs (checked: a JSON object of variables for the template, e.g. Qwen3's
    enable_thinking), or {}."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    own = sorted(_TEMPLATE_OWN.intersection(kwargs))
    if own or not all(k.isidentifier() for k in kwargs):
        raise ApiError(400, f"chat_template_kwargs must name template variables other than {sorted(_TEMPLATE_OWN)}"
                            f", got {own or sorted(k for k in kwargs if not k.isidentifier())}", "chat_template_kwargs")
    try:
        openai_structured.check_text(kwargs, "chat_template_kwargs")
    except FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    return kwargs


def render_chat(messages: list[dict], tokenizer, tools: ToolRequest | None = None,
                template_kwargs: dict | None = None) -> str:
    """The prompt text of parsed messages: the model's chat template (which writes any BOS itself), given the tools
    as HF's apply_chat_template(tools=...) gives them (also under tool_choice none, as vLLM does), and the
    request's chat_template_kwargs as more variables."""
    try:
        return tokenizer.apply_chat_template(messages, **(template_kwargs or {}),
                                             **({"tools": tools.tools} if tools is not None else {}))
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
