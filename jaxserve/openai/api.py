"""The OpenAI wire format: request bodies checked and turned into (prompt, SamplingParams), outputs into response
and stream-chunk bodies. Pure functions, no HTTP: `jaxserve.server` moves the bytes.

A field the API defines but the engine does not implement is refused unless it has its no-op value (`echo`
false), and an unknown field is refused: a client never gets silently different sampling.
"""
from __future__ import annotations

import json
import time
import uuid

from jaxserve.openai import structured as openai_structured

from jaxserve.openai import tool_calls
from jaxserve.openai.structured import FieldError
from jaxserve.outputs import CompletionOutput
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP, SamplingParams
from jaxserve.tokenizer import check_unicode
from jaxserve.openai.tool_calls import ToolRequest

MAX_N = 16
MAX_PROMPTS = 64


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# field: the JSON types it accepts. Sampling fields common to both endpoints, then each endpoint's own.
_NUMBER = (int, float)
_COMMON = {
    "model": (str,), "max_tokens": (int,), "max_completion_tokens": (int,), "temperature": _NUMBER,
    "top_p": _NUMBER, "top_k": (int,), "min_p": _NUMBER, "seed": (int,), "stop": (str, list), "n": (int,),
    "stream": (bool,), "stream_options": (dict,), "user": (str,), "ignore_eos": (bool,), "min_tokens": (int,),
    "stop_token_ids": (list,), "include_stop_str_in_output": (bool,), "skip_special_tokens": (bool,),
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "logit_bias": (dict,), "best_of": (int,),
    # vLLM's extensions for logit controls.
    "repetition_penalty": _NUMBER, "allowed_token_ids": (list,), "bad_words": (list,),
    # Accepted only at their neutral values (below), so common wrappers that always send them still work.
    "metadata": (dict,), "store": (bool,), "service_tier": (str,),
    **openai_structured.FIELDS,  # response_format, structured_outputs, guided_*
}
_COMPLETION = {**_COMMON, "prompt": (str, list), "logprobs": (int,), "echo": (bool,), "suffix": (str,),
               "prompt_logprobs": (int,), **tool_calls.FIELDS}  # tools: accepted at their neutral values only
_CHAT = {**_COMMON, "messages": (list,), "logprobs": (bool,), "top_logprobs": (int,), "prompt_logprobs": (int,),
         **tool_calls.FIELDS}  # tools, tool_choice, parallel_tool_calls


def check_body_fields(body, fields: dict) -> None:
    """A JSON object whose every field is one of `fields` (name -> the JSON types it accepts), or a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in fields:
            raise ApiError(400, f"unknown field {key!r}", key)
        if value is None:
            continue  # null means "the default", as OpenAI's SDKs send it
        types = fields[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            names = " or ".join({str: "a string", int: "an integer", float: "a number", bool: "a boolean",
                                 list: "an array", dict: "an object"}[t] for t in types)
            raise ApiError(400, f"{key} must be {names}, got {type(value).__name__}", key)


def _check_fields(body, fields: dict) -> None:
    check_body_fields(body, fields)
    # Defined by the API, not implemented here: refused unless harmless.
    for key, neutral in [("suffix", None), ("store", False), ("service_tier", "auto")]:
        if body.get(key) not in (None, neutral):
            raise ApiError(400, f"{key} {body[key]!r} is not supported by this server", key)
    if body.get("best_of") not in (None, 1 if body.get("n") is None else body["n"]):
        raise ApiError(400, "best_of other than n is not supported by this server", "best_of")


def _check_text(text: str, param: str, what: str) -> None:
    try:
        check_unicode(text, what)
    except ValueError as e:
        raise ApiError(400, str(e), param) from None


class ContextLengthError(ApiError):
    """The 400 for a request too long for the model's max_model_len: its own kind, so that a cascade can move such a
    request past a tier that cannot take it (the body is ApiError's)."""


def context_length_error(limit: int, prompt_tokens: int, max_tokens: int | None,
                         at_least: bool = False) -> ContextLengthError:
    """The 400 for prompt + max_tokens past max_model_len (as vLLM's); `at_least`: prompt_tokens is a floor found
    from the prompt's length, before tokenizing it."""
    generate = max_tokens or 1
    floor = "at least " if at_least else ""
    return ContextLengthError(400, f"this model's maximum context length is {limit} tokens; the request asks for "
                                   f"{floor}{prompt_tokens + generate} ({floor}{prompt_tokens} in the prompt, "
                                   f"{generate} to generate)")


def _structured_outputs(body: dict, tools: ToolRequest | None = None):
    """The grammar a request asks for: its structured-output field's, or the one that enforces its tool calls."""
    try:
        structured = openai_structured.parse_structured(body)
    except FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    enforced = tools.structured_outputs() if tools is not None else None
    if enforced is not None and structured is not None:
        raise ApiError(400, f"tool_choice {tools.choice if tools.choice != 'function' else 'naming a function'} "
                            f"is enforced by a grammar, so {structured.field} cannot be used with it", "tool_choice")
    return enforced if enforced is not None else structured.params if structured is not None else None


def grammar_error(body: dict, error: ValueError) -> ApiError:
    """The 400 for a grammar the engine could not compile (its ValueError names structured_outputs.KIND): named
    after the request's own field."""
    field = grammar_field(body)
    kind, _, reason = str(error).partition(": ")
    return ApiError(400, f"{field}: {reason}" if field and reason and kind.startswith("structured_outputs")
                    else str(error), field)


def grammar_field(body: dict) -> str | None:
    """The request field a grammar the engine could not compile is blamed on (the 400's param)."""
    try:
        tools = tool_calls.parse_tools(body) if "messages" in body else None
        if tools is not None and tools.structured_outputs() is not None:
            return "tools"
        structured = openai_structured.parse_structured(body)
    except FieldError:
        return None
    return structured.field if structured is not None else None


def _sampling_params(body: dict, max_tokens_default: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None, tools: ToolRequest | None = None) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens == 0 and prompt_logprobs is None:
        raise ApiError(400, "max_tokens 0 (score the prompt without generating) needs echo or prompt_logprobs",
                       "max_tokens")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop sequences", "stop")
    for text in [stop] if isinstance(stop, str) else stop or []:
        if isinstance(text, str):  # SamplingParams refuses the rest
            _check_text(text, "stop", "a stop string")
    n = 1 if body.get("n") is None else body["n"]
    if isinstance(n, int) and n > MAX_N:
        raise ApiError(400, f"n must be at most {MAX_N}", "n")
    temperature = body.get("temperature")
    if isinstance(temperature, _NUMBER) and temperature > 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    args = dict(n=n, temperature=1.0 if temperature is None else temperature, max_tokens=max_tokens, stop=stop,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=_structured_outputs(body, tools))
    for key in ("top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens", "stop_token_ids",
                "include_stop_str_in_output", "skip_special_tokens", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "allowed_token_ids", "bad_words"):
        if body.get(key) is not None:
            args[key] = body[key]
    if body.get("logit_bias") is not None:
        args["logit_bias"] = _logit_bias(body["logit_bias"])
    try:
        return SamplingParams(**args)
    except ValueError as e:
        raise ApiError(400, str(e), getattr(e, "param", None)) from None


def _logit_bias(bias: dict) -> dict:
    """OpenAI's logit_bias: token ids as JSON object keys (strings) -> biases."""
    if len(bias) > MAX_LOGIT_BIAS:  # before converting a huge object key by key
        raise ApiError(400, f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def parse_completion(body) -> tuple[list, SamplingParams]:
    """-> (prompts: each a text or {"prompt_token_ids": [...]}, params). A list of texts or of token-id lists is a
    batch: one engine request per prompt."""
    _check_fields(body, _COMPLETION)
    # Wrappers that always send the chat fields: harmless unless they ask for tools.
    for key, neutral in [("tools", []), ("tool_choice", "none")]:
        if body.get(key) not in (None, neutral):
            raise ApiError(400, f"{key} is for chat completions (/v1/chat/completions) only", key)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompt = [prompt]
    if not (isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS):
        raise ApiError(400, f"prompt must be a string, an array of token ids, or an array of up to {MAX_PROMPTS} "
                            f"of either", "prompt")
    prompts = []
    for p in prompt:
        if _is_token_ids(p):
            prompts.append({"prompt_token_ids": p})
        elif isinstance(p, str) and p:
            _check_text(p, "prompt", "the prompt")
            prompts.append(p)
        else:
            raise ApiError(400, "each prompt must be a non-empty string or a non-empty array of token ids", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise ApiError(400, f"logprobs must be in [0, 5], got {logprobs}", "logprobs")  # OpenAI's bound
    # The prompt's logprobs are computed once, for the larger of what echo's logprobs and vLLM's prompt_logprobs show
    # (each shows its own top n); echo with max_tokens 0 scores the prompt even if nobody reads the scores.
    wanted = [n for n in (_prompt_logprobs(body), logprobs if body.get("echo") else None) if n is not None]
    requested = body.get("max_completion_tokens")
    if requested is None:
        requested = body.get("max_tokens")
    if body.get("echo") and requested == 0 and not wanted:
        wanted = [0]
    # 16: OpenAI's default max_tokens for completions
    return prompts, _sampling_params(body, 16, logprobs, max(wanted) if wanted else None)


def _prompt_logprobs(body: dict) -> int | None:
    n = body.get("prompt_logprobs")
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}", "prompt_logprobs")
    return n


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_chat(body) -> tuple[list[dict], SamplingParams, ToolRequest | None]:
    """-> (messages, params, tools); `render_chat` makes the prompt, off the event loop."""
    _check_fields(body, _CHAT)
    messages = body.get("messages")
    if not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        tools = tool_calls.parse_tools(body)
    except FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    top = body.get("top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if top and not body.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return messages, _sampling_params(body, None, (top or 0) if body.get("logprobs") else None,
                                      _prompt_logprobs(body), tools), tools


def _message(m, i: int) -> dict:
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
    _check_text(m["content"], "messages", f"messages[{i}].content")
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
    except ValueError:
        raise ApiError(400, f"{where}.function.arguments is not JSON text", "messages") from None
    try:
        openai_structured.check_text(arguments, f"{where}.function.arguments")
    except FieldError as e:
        raise ApiError(400, str(e), "messages") from None
    return {**call, "type": "function", "function": {**fn, "arguments": arguments}}


def render_chat(messages: list[dict], tokenizer, tools: ToolRequest | None = None) -> str:
    """The prompt text of parsed messages: the model's chat template (which writes any BOS itself), given the tools
    as HF's apply_chat_template(tools=...) gives them (also under tool_choice none, as vLLM does)."""
    try:
        return tokenizer.apply_chat_template(messages, **({"tools": tools.tools} if tools is not None else {}))
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def wants_usage_in_stream(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if set(options) - {"include_usage"}:
        raise ApiError(400, f"unknown stream_options {sorted(set(options) - {'include_usage'})}", "stream_options")
    return bool(options.get("include_usage"))


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(out: CompletionOutput, token_text, offset: int) -> dict | None:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (from `offset`)."""
    if out.logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(out.token_ids, out.logprobs):
        text = token_text(token_id)
        tokens.append(text)
        lps.append(entry[token_id].logprob)
        tops.append({token_text(t): lp.logprob for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], scored: list, token_text, top: int) -> dict:
    """Legacy completions logprobs of an echoed prompt (as OpenAI's API gave them): the first token's logprob and
    top_logprobs are None; each other's top_logprobs holds the top `top` and the token itself."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(prompt_ids, scored):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(entry[token_id].logprob)
            tops.append({token_text(t): lp.logprob for t, lp in _top(entry, token_id, top)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(prompt_ids: list[int], scored: list, top: int) -> list:
    """vLLM's `prompt_logprobs`: None, then per position {token id: {logprob, rank, decoded_token}} holding the
    prompt token and the top `top`."""
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in _top(entry, token_id, top)} for token_id, entry in zip(prompt_ids, scored)]


def _top(entry: dict, token_id: int, top: int):
    """An entry's token and its top `top` (it may hold more: the prompt is scored once for every view of it)."""
    return [(t, lp) for t, lp in entry.items() if t == token_id or lp.rank <= top]


def chat_logprobs(out: CompletionOutput, token_text, top: int, token_bytes=None) -> dict | None:
    """Chat logprobs. `bytes` come from `token_bytes` (Tokenizer.token_bytes), not from the token's text: a token
    holding part of a character reads as U+FFFD. Without it (no tokenizer) they are the text's UTF-8."""
    if out.logprobs is None:
        return None
    token_bytes = token_bytes or (lambda t: token_text(t).encode())
    content = []
    for token_id, entry in zip(out.token_ids, out.logprobs):
        def item(t, lp):
            return {"token": token_text(t), "logprob": lp.logprob, "bytes": list(token_bytes(t))}
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


def completion_body(request_id: str, model: str, choices: list[dict], usage_: dict | None, chat: bool,
                    chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
