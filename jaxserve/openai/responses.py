"""Outputs into OpenAI response and stream-chunk bodies: ids, usage, the logprobs of each endpoint, the body
around the choices. Pure functions, no HTTP: `jaxserve.server` moves the bytes."""
from __future__ import annotations

import time
import uuid

from jaxserve.outputs import CompletionOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: of the prompt tokens, those served from the prefix cache. Always sent, 0 included, as OpenAI
    sends it (vLLM sends it only under --enable-prompt-tokens-details, and then only when not 0)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
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
