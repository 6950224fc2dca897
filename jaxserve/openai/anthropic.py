"""Anthropic's Messages API, the request's side: a /v1/messages (or /v1/messages/count_tokens) body checked and turned
into the chat completions body it means, so that the chat path (`requests.parse_chat`, `chat_messages`,
`tool_calls`) does the rest: one pipeline, one set of checks, one tool-call parser. Also Anthropic's error body.

- `system` (a string or text blocks) becomes the first message; `messages` hold a string or blocks: text, tool_use
  (an assistant's call) and tool_result (its answer, a string or text blocks); an earlier turn's thinking blocks
  are dropped, as Anthropic drops them from the context. Images and documents are refused: the models served read
  text.
- `tools` ({name, description, input_schema}) become functions; `tool_choice` auto / any / tool / none become auto /
  required / a named function / none; `disable_parallel_tool_use` is parallel_tool_calls false.
- `max_tokens` is required (as Anthropic); `stop_sequences` is stop; temperature, top_p, top_k as they are.
- `metadata`, `cache_control` (anywhere: the prefix cache is automatic) and `service_tier` auto are accepted and
  change nothing; any other field is a 400 naming it.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.openai.errors import ApiError
from jaxserve.openai.requests import check_body_fields

_NUMBER = (int, float)
# Fields of both routes, then /v1/messages' own (count_tokens takes no sampling fields).
_COUNT_FIELDS = {"model": (str,), "messages": (list,), "system": (str, list), "tools": (list,),
                 "tool_choice": (dict,), "thinking": (dict,), "cache_control": (dict,)}
_MESSAGE_FIELDS = {**_COUNT_FIELDS, "max_tokens": (int,), "stop_sequences": (list,), "temperature": _NUMBER,
                   "top_p": _NUMBER, "top_k": (int,), "stream": (bool,), "metadata": (dict,), "service_tier": (str,)}
# A block's fields (cache_control anywhere: accepted, the prefix cache is automatic; is_error: the result is passed
# on as it is, the model reads whether it failed).
_BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                 "tool_use": {"type", "id", "name", "input", "cache_control"},
                 "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
                 "thinking": {"type", "thinking", "signature"}, "redacted_thinking": {"type", "data"}}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens

# Anthropic's error types by status (its API reference's list): what its clients raise on.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    """An error as Anthropic's body: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


@dataclasses.dataclass(frozen=True)
class Thinking:
    """What the request's `thinking` asks: enabled (thinking blocks, which need a reasoning parser), adaptive (the
    model's reasoning shown if it has any) or disabled."""
    kind: str = "disabled"

    @property
    def shown(self) -> bool:
        return self.kind != "disabled"

    @property
    def required(self) -> bool:
        return self.kind == "enabled"


def chat_body(body, count_only: bool = False) -> tuple[dict, Thinking]:
    """The chat completions body a Messages body means (count_only: a count_tokens body), and its thinking."""
    check_body_fields(body, _COUNT_FIELDS if count_only else _MESSAGE_FIELDS)
    chat: dict = {"model": body.get("model")}
    if not count_only:
        if body.get("max_tokens") is None:
            raise ApiError(400, "max_tokens: field required", "max_tokens")
        if body["max_tokens"] < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {body['max_tokens']}", "max_tokens")
        if body.get("service_tier") not in (None, "auto", "standard_only"):
            raise ApiError(400, f"service_tier must be auto or standard_only, got {body['service_tier']!r}",
                           "service_tier")
        temperature = body.get("temperature")
        if temperature is not None and not 0 <= temperature <= 1:  # Anthropic's range
            raise ApiError(400, f"temperature must be in [0, 1], got {temperature}", "temperature")
        chat.update(max_tokens=body["max_tokens"], stop=body.get("stop_sequences"), stream=body.get("stream"),
                    temperature=temperature, top_p=body.get("top_p"), top_k=body.get("top_k"))
    messages = body.get("messages")
    if not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    chat["messages"] = _system(body.get("system")) + [m for i, turn in enumerate(messages)
                                                      for m in _turn(turn, i)]
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"], body.get("tools")))
    return {k: v for k, v in chat.items() if v is not None}, _thinking(body.get("thinking"), body.get("max_tokens"))


def _text_blocks(blocks, where: str, field: str) -> str:
    """Text blocks ({type: text, text}) joined: images and other kinds are refused, naming them."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"{where} must be a string or an array of text blocks", field)
    for j, b in enumerate(blocks):
        _known_block(b, f"{where}[{j}]", field, ("text",))
    return "".join(b["text"] for b in blocks)


def _known_block(b, where: str, field: str, kinds: tuple[str, ...]) -> None:
    kind = b.get("type") if isinstance(b, dict) else None
    if kind in ("image", "document", "search_result", "container_upload"):
        raise ApiError(400, f"{where}: {kind} blocks are not supported by this server (its models read text)", field)
    if kind not in kinds:
        raise ApiError(400, f"{where} must be one of the block types {', '.join(kinds)}, got {kind!r}", field)
    needs = {"text": ("text", str), "tool_use": ("input", dict), "tool_result": ("tool_use_id", str),
             "thinking": ("thinking", str), "redacted_thinking": ("data", str)}[kind]
    unknown = set(b) - _BLOCK_FIELDS[kind]
    if unknown or b.get("citations") or b.get("is_error") not in (None, True, False):
        raise ApiError(400, f"{where}: unsupported fields of a {kind} block: {sorted(unknown) or ['citations']}"
                       if unknown or b.get("citations") else f"{where}.is_error must be a boolean", field)
    if not isinstance(b.get(needs[0]), needs[1]) or kind == "tool_use" and not (
            isinstance(b.get("id"), str) and isinstance(b.get("name"), str)):
        raise ApiError(400, f"{where}: a {kind} block needs {'id, name and ' if kind == 'tool_use' else ''}"
                            f"{needs[0]}", field)


def _system(system) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text_blocks(system, "system", "system")}]


def _turn(turn, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages (in their place),
    an assistant turn's tool_use blocks its tool_calls."""
    where = f"messages[{i}]"
    if not (isinstance(turn, dict) and turn.get("role") in ("user", "assistant")
            and set(turn) <= {"role", "content"}):
        raise ApiError(400, f"{where} must be {{role: user or assistant, content}}", "messages")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of blocks", "messages")
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    kinds = ("text", "tool_result") if role == "user" else ("text", "tool_use", "thinking", "redacted_thinking")
    for j, b in enumerate(content):
        _known_block(b, f"{where}.content[{j}]", "messages", kinds)
        if b["type"] == "text":
            text.append(b["text"])
        elif b["type"] == "tool_use":
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        elif b["type"] == "tool_result":
            if text:  # what the user wrote before it stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            answer = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": _text_blocks(answer, f"{where}.content[{j}].content", "messages")})
    if role == "assistant":  # content always a string: templates that know no tool calls read it
        return [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    return out + ([{"role": "user", "content": "".join(text)}] if text or not out else [])


def _tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"{where}: only custom tools ({{name, description, input_schema}}) are supported, not "
                            f"{kind!r}", "tools")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if unknown:
        raise ApiError(400, f"{where}: unsupported fields {sorted(unknown)}", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise ApiError(400, f"{where}.input_schema must be an object (a JSON schema)", "tools")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict, tools) -> dict:
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if unknown or kind not in ("auto", "any", "tool", "none") or (kind == "tool") != ("name" in choice):
        raise ApiError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...} '
                            '(with disable_parallel_tool_use)', "tool_choice")
    if not tools and kind != "none":
        raise ApiError(400, "tool_choice needs tools", "tool_choice")
    chosen = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
              else _TOOL_CHOICES[kind])
    out: dict = {"tool_choice": chosen if tools else None}
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise ApiError(400, "tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
        out["parallel_tool_calls"] = not disable if tools else None
    return out


def _thinking(thinking, max_tokens) -> Thinking:
    """`thinking`: enabled (budget_tokens at least 1024 and under max_tokens, as Anthropic checks it; not a separate
    limit here: max_tokens bounds reasoning and answer together), adaptive, or disabled."""
    if thinking is None:
        return Thinking()
    kind = thinking.get("type")
    allowed = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"},
               "disabled": {"type"}}.get(kind)
    if allowed is None or set(thinking) - allowed or thinking.get("display") not in (None, "summarized"):
        raise ApiError(400, 'thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                            '{"type": "disabled"} (display: summarized only)', "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= MIN_THINKING_BUDGET):
            raise ApiError(400, f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}",
                           "thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise ApiError(400, "thinking.budget_tokens must be less than max_tokens", "thinking")
    return Thinking(kind)
