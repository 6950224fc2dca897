"""Request bodies checked and turned into (prompt, SamplingParams): completions' prompts, chat's messages (their
checks in `chat_messages`), the sampling fields both share, and the grammar a request asks for.

A field the API defines but the engine does not implement is refused unless it has its no-op value (`echo`
false), and an unknown field is refused: a client never gets silently different sampling.
"""
from __future__ import annotations

from jaxserve.openai import structured as openai_structured
from jaxserve.openai import tool_calls
from jaxserve.openai.chat_messages import chat_template_kwargs, parse_message
from jaxserve.openai.errors import ApiError, check_request_text
from jaxserve.openai.structured import FieldError
from jaxserve.openai.tool_calls import ToolRequest
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP, SamplingParams

MAX_N = 16
MAX_PROMPTS = 64


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
         "chat_template_kwargs": (dict,),  # vLLM's: more template variables (chat_messages.chat_template_kwargs)
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


def _structured_outputs(body: dict, tools: ToolRequest | None = None):
    """The grammar a request asks for: its structured-output field's, or the one that enforces its tool calls."""
    try:
        structured = openai_structured.parse_structured(body)
    except FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    enforced = tools.structured_outputs() if tools is not None else None
    if tools is not None and enforced is not None and structured is not None:
        raise ApiError(400, f"tool_choice {tools.choice if tools.choice != 'function' else 'naming a function'} "
                            f"is enforced by a grammar, so {structured.field} cannot be used with it", "tool_choice")
    return enforced if enforced is not None else structured.params if structured is not None else None


def grammar_error(body: dict, error: ValueError | TypeError) -> ApiError:
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
            check_request_text(text, "stop", "a stop string")
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
    prompts: list[str | dict] = []
    for p in prompt:
        if _is_token_ids(p):
            prompts.append({"prompt_token_ids": p})
        elif isinstance(p, str) and p:
            check_request_text(p, "prompt", "the prompt")
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
    messages = [parse_message(m, i) for i, m in enumerate(messages)]
    chat_template_kwargs(body)  # checked here, with the rest of the body: a 400 before anything is admitted
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


def wants_usage_in_stream(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if set(options) - {"include_usage"}:
        raise ApiError(400, f"unknown stream_options {sorted(set(options) - {'include_usage'})}", "stream_options")
    return bool(options.get("include_usage"))
