"""The client's answer from both servers': the prefill's first-token answer joined with the decode's stream, whole
(one body) or streamed (the first token at once, then the decode's chunks). The id is the prefill's, usage adds both
sides' completion tokens, logprobs are joined (completions' text_offset shifted past the first token's text)."""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from aiohttp import web

from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import write_stream
from jaxserve.openai.requests import wants_usage_in_stream
from jaxserve.openai.responses import usage
from jaxserve.openai.tool_parsers import assemble
from jaxserve.router.upstream import ServerAnswer, ServerFailure

logger = logging.getLogger("jaxserve")


class JoinedAnswer:
    """One request's answer: `first` is the prefill server's JSON answer (one choice, its kv_transfer_params taken
    out); `decoded` the decode server's events (see PDRequest.decode_events), or None when the first token ended the
    request."""

    def __init__(self, request: web.Request, body: dict, chat: bool, first: dict,
                 decoded: AsyncIterator[dict] | None, stream_write_timeout_s: float):
        self.request, self.body, self.chat, self.first, self.decoded = request, body, chat, first, decoded
        self.stream_write_timeout_s = stream_write_timeout_s

    async def whole(self) -> web.Response:
        first = self.first
        if self.decoded is None:  # the first token ended it
            return web.json_response(first)
        choice = first["choices"][0]
        texts, logprobs, deltas, finish, completion_tokens = [], [], [], None, 0
        try:
            async for event in self.decoded:
                if "error" in event:  # the decode failed after its start (its status line said 200)
                    unavailable = event["error"].get("type") == "service_unavailable"
                    return web.json_response(event, status=503 if unavailable else 500)
                if event.get("usage"):
                    completion_tokens = event["usage"].get("completion_tokens", 0)
                for c in event.get("choices", []):
                    if self.chat:
                        deltas.append(c.get("delta") or {})
                    else:
                        texts.append(c.get("text") or "")
                    if c.get("logprobs") is not None:
                        logprobs.append(c["logprobs"])
                    finish = c.get("finish_reason") or finish
        except ServerAnswer as e:
            return e.response()
        except ServerFailure as e:
            logger.warning("request %s: %s", first.get("id"), e.message)
            raise ApiError(e.status, e.public) from None
        joined = self._join_logprobs(choice.get("logprobs"), logprobs)
        if self.chat:
            content, calls = assemble(deltas)
            text = (choice.get("message", {}).get("content") or "") + (content or "")
            message = {"role": "assistant", "content": (text or None) if calls else text}
            if calls:
                message["tool_calls"] = calls
            merged = {**choice, "message": message, "logprobs": joined, "finish_reason": finish}
        else:
            merged = {**choice, "text": choice.get("text", "") + "".join(texts), "logprobs": joined,
                      "finish_reason": finish}
        return web.json_response({**first, "choices": [merged], "usage": self._usage(completion_tokens)})

    def _usage(self, decoded: int) -> dict:
        u = self.first.get("usage") or {}
        # The prompt is the prefill server's: so are its tokens found in the prefix cache.
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0) + decoded, cached)

    def _join_logprobs(self, first: dict | None, rest: list[dict]) -> dict | None:
        if first is None:
            return None
        if self.chat:
            return {"content": [*first.get("content", []), *(x for lp in rest for x in lp.get("content") or [])]}
        shift = text_end(first)
        joined = {k: list(v) for k, v in first.items()}
        for lp in rest:
            for k, v in lp.items():
                joined.setdefault(k, []).extend([o + shift for o in v] if k == "text_offset" else v)
        return joined

    async def stream(self) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        first = self.first
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": first["id"], "object": kind, "created": first["created"], "model": first["model"]}

        async def send(body: dict) -> None:
            await write_stream(self.request, resp, b"data: " + json.dumps(body).encode() + b"\n\n",
                               self.stream_write_timeout_s)

        try:
            await self._send_first_token(send, head)
            decoded, failed = 0, False
            if self.decoded is not None:
                decoded, failed = await self._send_decoded(send, head)
            # (the prefill server has checked stream_options by now)
            if wants_usage_in_stream(self.body) and not failed:  # (as a server's stream: an error event, then [DONE])
                await send({**head, "choices": [], "usage": self._usage(decoded)})
            await write_stream(self.request, resp, b"data: [DONE]\n\n", self.stream_write_timeout_s, eof=True)
        except ConnectionError:  # the client is gone or stopped reading (dropped): nothing to tell it
            pass
        return resp

    async def _send_first_token(self, send, head: dict) -> None:
        """The first token at once, as a server's own stream starts."""
        first, choice = self.first, self.first["choices"][0]
        if not self.chat:
            await send({**head, "choices": [{k: v for k, v in choice.items()}]})
            return
        await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        message = choice.get("message") or {}
        delta = {"content": message["content"]} if message.get("content") else {}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        extra = {"prompt_logprobs": first["prompt_logprobs"]} if "prompt_logprobs" in first else {}
        await send({**head, "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"),
                                         "finish_reason": choice.get("finish_reason")}], **extra})

    async def _send_decoded(self, send, head: dict) -> tuple[int, bool]:
        """The decode's chunks under the prefill's id: (its completion tokens, whether it failed)."""
        shift = text_end(self.first["choices"][0].get("logprobs")) if not self.chat else 0
        decoded = 0
        try:
            async for event in self.decoded:
                if "error" in event:
                    await send(event)
                    return decoded, True
                if not event.get("choices"):
                    decoded = (event.get("usage") or {}).get("completion_tokens", 0)
                    continue
                c = event["choices"][0]
                if self.chat and "role" in (c.get("delta") or {}):
                    continue  # the role went out with the first token
                if shift and c.get("logprobs") and "text_offset" in c["logprobs"]:
                    c["logprobs"]["text_offset"] = [o + shift for o in c["logprobs"]["text_offset"]]
                await send({**event, "id": head["id"]})
        except ServerAnswer as e:
            await send(e.event())
            return decoded, True
        except ServerFailure as e:
            logger.warning("request %s: %s", head["id"], e.message)
            await send(ApiError(e.status, f"decode failed after the first token: {e.public}").body())
            return decoded, True
        return decoded, False


def text_end(lp: dict | None) -> int:
    """Where the text after a completions logprobs object starts (its text_offset frame)."""
    if not lp or not lp.get("tokens"):
        return 0
    return lp["text_offset"][-1] + len(lp["tokens"][-1])
