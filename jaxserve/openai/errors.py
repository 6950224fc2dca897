"""The errors a request is answered with: OpenAI's error body, and the 400 for a request too long for the model."""
from __future__ import annotations

from jaxserve.tokenizer import check_unicode


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # A client's error (4xx: a body too large, a wrong method, ...) is OpenAI's invalid_request_error unless it
        # has a type of its own; the server's (5xx) a server_error.
        self.type = type or {401: "authentication_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500
                                                             else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


def check_request_text(text: str, param: str, what: str) -> None:
    """A 400 naming `param` if `text` (`what`) holds a lone surrogate: no UTF-8 spells it."""
    try:
        check_unicode(text, what)
    except ValueError as e:
        raise ApiError(400, str(e), param) from None
