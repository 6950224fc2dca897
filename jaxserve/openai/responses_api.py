"""OpenAI's Responses API, the request's side: a /v1/responses body checked and turned into the chat completions
request it means (messages, tools, tool_choice, response_format, sampling fields), which the chat path then parses,
renders and runs: one pipeline, its tool-call parsing and structured output included.

- `input`: a string (one user message) or items: messages (user, system, developer, assistant; input_text and
  output_text parts), function_call items (an assistant's tool calls, consecutive ones one turn) and
  function_call_output items (tool messages). Reasoning items sent back are not rendered: chat templates drop
  earlier turns' reasoning, as Qwen3's does.
- `instructions`: a system message first (not carried over by previous_response_id, as OpenAI's).
- `tools` are flat ({type: function, name, description, parameters, strict}); `tool_choice` none, auto, required
  or {type: function, name}; `text.format` text, json_object or json_schema ({name, schema, strict,
  description}); `max_output_tokens`; the chat path's sampling fields (temperature, top_p, seed, top_k, stop, ...).
- Refused with a 400 naming the field: built-in tools, background, conversation, prompt templates, include values,
  reasoning effort, truncation auto, and any field this module does not know. Nothing is silently ignored.
"""
from __future__ import annotations

import dataclasses

from jaxserve.openai.errors import ApiError
from jaxserve.openai.requests import check_body_fields

_NUMBER = (int, float)
# The chat path's own sampling fields (vLLM's Responses request takes the same extensions), passed as they are.
SAMPLING = {"temperature": _NUMBER, "top_p": _NUMBER, "top_k": (int,), "min_p": _NUMBER, "seed": (int,),
            "stop": (str, list), "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER,
            "repetition_penalty": _NUMBER, "logit_bias": (dict,), "ignore_eos": (bool,), "min_tokens": (int,),
            "stop_token_ids": (list,), "include_stop_str_in_output": (bool,), "skip_special_tokens": (bool,),
            "allowed_token_ids": (list,), "bad_words": (list,)}
FIELDS = {"model": (str,), "input": (str, list), "instructions": (str,), "tools": (list,),
          "tool_choice": (str, dict), "parallel_tool_calls": (bool,), "text": (dict,), "max_output_tokens": (int,),
          "stream": (bool,), "store": (bool,), "previous_response_id": (str,), "metadata": (dict,), "user": (str,),
          "include": (list,), "reasoning": (dict,), "truncation": (str,), "service_tier": (str,),
          "background": (bool,), **SAMPLING}
# OpenAI's fields this server does not implement: refused unless null (or their neutral value, where they have one).
REFUSED = {"conversation", "prompt", "max_tool_calls", "prompt_cache_key", "prompt_cache_retention",
           "prompt_cache_options", "safety_identifier", "stream_options", "top_logprobs", "context_management",
           "moderation", "background_options", "access_programs", "image"}
_NEUTRAL = {"background": (False,), "truncation": ("disabled",), "service_tier": ("auto", "default"),
            "include": ([],)}
# Where the chat path's 400 names its own field, the Responses field the client sent.
_CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    body: dict  # as sent (checked)
    items: list[dict]  # the input as items (a string input as one user message item)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def store(self) -> bool:
        return self.body.get("store") is not False  # OpenAI stores by default

    @property
    def previous_response_id(self) -> str | None:
        return self.body.get("previous_response_id")

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completions request this one means, after the conversation `history` (the items of the
        previous response's input and output, oldest first)."""
        body = self.body
        chat: dict = {k: body[k] for k in (*SAMPLING, "model", "parallel_tool_calls", "user") if k in body}
        messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        chat["messages"] = messages + items_to_messages(history + self.items)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("tools"):
            chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body["tools"])]
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
        text_format = (body.get("text") or {}).get("format")
        if text_format is not None:
            chat["response_format"] = _response_format(text_format)
        return chat


def parse_responses(body) -> ResponsesRequest:
    """A Responses request body, checked (ApiError 400 naming the field)."""
    unknown_but_openai = [k for k in REFUSED if isinstance(body, dict) and body.get(k) is not None]
    if unknown_but_openai:
        raise ApiError(400, f"{unknown_but_openai[0]} is not supported by this server", unknown_but_openai[0])
    check_body_fields(body, FIELDS)
    for key, neutral in _NEUTRAL.items():
        if body.get(key) is not None and body[key] not in neutral:
            raise ApiError(400, f"{key} {body[key]!r} is not supported by this server", key)
    reasoning = body.get("reasoning") or {}
    if any(v is not None for v in reasoning.values()):
        raise ApiError(400, "reasoning options (effort, summary) are not supported by this server: a model with a "
                            "reasoning parser reasons as its template makes it", "reasoning")
    text = body.get("text") or {}
    if set(text) - {"format"} or (text.get("format") is not None and not isinstance(text["format"], dict)):
        raise ApiError(400, "text must be {format: {type: text | json_object | json_schema, ...}} (verbosity is not "
                            "supported)", "text")
    if not isinstance(body.get("input"), (str, list)) or not body["input"]:
        raise ApiError(400, "input must be a non-empty string or array of items", "input")
    inp = body["input"]
    items = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else inp
    for i, item in enumerate(items):
        _check_item(item, i)
    return ResponsesRequest(body, items)


def chat_error(e: ApiError) -> ApiError:
    """The chat path's 400 about a field, named after the Responses field it came from."""
    param = _CHAT_FIELDS.get(e.param or "")
    if param is None:
        return e
    return ApiError(e.status, e.message.replace(e.param or "", param), param, e.code, e.type)


def _check_item(item, i: int) -> None:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object (a message, function_call or function_call_output item)",
                       "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ("message", "function_call", "function_call_output", "reasoning"):
        raise ApiError(400, f"{where}: items of type {kind!r} are not supported (message, function_call, "
                            f"function_call_output)", "input")
    if kind == "function_call" and not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise ApiError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
    if kind == "function_call_output" and not (isinstance(item.get("call_id"), str)
                                               and isinstance(item.get("output"), (str, list))):
        raise ApiError(400, f"{where}: a function_call_output needs call_id and output (a string)", "input")


def items_to_messages(items: list[dict]) -> list[dict]:
    """Checked input items -> chat messages (the chat path checks each message further)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], f"input[{i}].output")})
    return messages


def _text(content, where: str):
    """A message's content: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content[{j}]: only input_text and output_text parts are supported, got "
                                f"{kind!r}", "input")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool, i: int) -> dict:
    """A flat Responses function tool -> the chat path's {type: function, function: {...}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ApiError(400, f"tools[{i}]: tools of type {kind!r} are not supported (built-in tools such as "
                            f"web_search or file_search are not served here): use type function", "tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise ApiError(400, "tool_choice must be none, auto, required or {type: function, name} (allowed_tools "
                                f"and built-in tool types are not supported), got {choice!r}"[:300], "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: dict) -> dict:
    """text.format -> chat's response_format (json_schema's fields flat here, nested there)."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise ApiError(400, f"unknown text.format fields {sorted(set(fmt) - {'type'})}", "text")
        return {"type": kind}
    if kind != "json_schema":
        raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
