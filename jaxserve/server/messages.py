"""Anthropic's Messages API as vLLM's and llama.cpp's servers serve it: POST /v1/messages (whole or streamed) and
POST /v1/messages/count_tokens, over the chat completions path. The body becomes the chat body it means
(`jaxserve.openai.anthropic`), which the chat path checks, renders, admits and runs (its tool-call parser
included); its deltas become Anthropic's content blocks (`jaxserve.openai.anthropic_output`). Errors on these
routes are Anthropic's body, the API key is taken from `x-api-key` as from `Authorization: Bearer` (the server's
auth middleware), and `anthropic-version` / `anthropic-beta` headers are accepted as they come."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from jaxserve.openai.anthropic import chat_body, error_body
from jaxserve.openai.anthropic_output import (
    MessageBuilder,
    event,
    message_body,
    new_message_id,
    stop_reason,
    usage,
)
from jaxserve.openai.chat_messages import render_chat
from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import as_api_error, error_response, write_stream
from jaxserve.openai.requests import parse_chat
from jaxserve.server.responses import CompletionResponse
from jaxserve.server.served_model import ServedModel

PATH = "/v1/messages"


def add_routes(app: web.Application, server) -> None:
    """The routes on `server` (the jaxserve.server.app.Server: its admission, targets and engine runs)."""
    routes = Messages(server)
    app.router.add_post(PATH, routes.create)
    app.router.add_post(PATH + "/count_tokens", routes.count_tokens)


@web.middleware
async def errors(request, handler):
    """The errors of Anthropic's routes (a refused API key included: this runs outside the auth middleware) in
    Anthropic's body, with the status the OpenAI routes would answer."""
    if not request.path.startswith(PATH):
        return await handler(request)
    try:
        return await handler(request)
    except Exception as e:  # noqa: BLE001 - as_api_error logs a bug and makes it a 500
        error, headers = as_api_error(request, e)
        return error_response(error, headers, error_body(error))


class Messages:
    def __init__(self, server):
        self.server = server

    def _model(self, chat: dict) -> tuple[ServedModel, Any]:
        """The served model (and adapter) the request names, refused where these routes are not served."""
        return self.server.chat_built_target(chat, PATH)

    async def count_tokens(self, request) -> web.Response:
        """{"input_tokens"}: the prompt the same request would be, rendered by the chat template and tokenized (not
        limited by the model's length: a client counts to find out whether it fits)."""
        chat, _ = chat_body(await self.server._body(request), count_only=True)
        m, _ = self._model(chat)
        messages, _, tools = parse_chat(chat)

        def count() -> int:
            try:
                return len(m.tokenizer.encode(render_chat(messages, m.tokenizer, tools), add_special_tokens=False))
            except ValueError as e:  # text no tokenizer takes (a lone surrogate from the template's other fields)
                raise ApiError(400, str(e)) from None
        with self.server._admitted(m, 1):
            return web.json_response({"input_tokens": await m.off_loop(1, count)})

    async def create(self, request) -> web.StreamResponse:
        server = self.server
        chat, thinking = chat_body(await server._body(request))
        m, adapter = self._model(chat)
        messages, params, tools = parse_chat(chat)
        params = m.chat_params(params, tools)
        # The chat path splits the reasoning (the served model's --reasoning-parser) into reasoning_content deltas,
        # before its tool-call parser reads the answer: the builder shows them as thinking blocks, or drops them.
        if thinking.required and m.reasoning_parser is None:
            raise ApiError(400, "thinking needs a server started with --reasoning-parser (this model's reasoning "
                                "cannot be told from its answer)", "thinking")
        with server._admitted(m, params.n):
            prompt = await server.chat_prompt(m, messages, params, tools)
            name = adapter.name if adapter is not None else m.name
            run = CompletionResponse(m, chat, params, True, 1, server.stream_write_timeout_s, tools, name)
            lora = {"lora_request": adapter.lora_request} if adapter is not None else {}
            answer = Answer(run, MessageBuilder(thinking.shown))
            async with server.running(m, adapter, run, chat, [prompt], params, lora) as outputs:
                if chat.get("stream"):
                    return await answer.stream(request, outputs, len(prompt["prompt_token_ids"]))
                return await answer.whole(outputs)


class Answer:
    """One request's answer: the chat path's deltas through a MessageBuilder, whole or as Anthropic's stream."""

    def __init__(self, run: CompletionResponse, builder: MessageBuilder):
        self.run, self.builder = run, builder
        self.id = new_message_id()
        self.stop: tuple[str | None, Any] = (None, None)

    async def _events(self, outputs):
        """The stream events of each new piece, the finish noted."""
        async for _, entries, c in self.run.chat_deltas(outputs):
            yield b"".join(self.builder.feed(e["delta"]) for e in entries)
            if entries[-1]["finish_reason"] is not None:
                self.stop = (entries[-1]["finish_reason"], c.stop_reason)

    def _usage(self) -> dict:
        run = self.run
        return usage(run.prompt_tokens[0], run.tokens[0], run.cached_tokens[0])

    def _body(self, content: list[dict], stop=(None, None), usage_: dict | None = None) -> dict:
        return message_body(self.id, self.run.name, content, stop, usage_ or self._usage())

    async def whole(self, outputs) -> web.Response:
        async for _ in self._events(outputs):
            pass
        self.builder.finish()
        return web.json_response(self._body(self.builder.content(), stop_reason(*self.stop)))

    async def stream(self, request, outputs, prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def write(data: bytes, eof: bool = False) -> None:
            await write_stream(request, resp, data, self.run.stream_write_timeout_s, eof)

        try:
            # The prompt's tokens are known; which of them the prefix cache holds, only once it runs (message_delta).
            start = self._body([], usage_=usage(prompt_tokens, 0, 0))
            await write(event("message_start", {"type": "message_start", "message": start})
                        + event("ping", {"type": "ping"}))
            try:
                async for data in self._events(outputs):
                    await write(data)
                reason, sequence = stop_reason(*self.stop)
                await write(self.builder.finish() + event("message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self._usage()}))
                await write(event("message_stop", {"type": "message_stop"}), eof=True)
            except ConnectionError:
                raise
            except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream
                error, _ = as_api_error(request, e)
                await write(event("error", error_body(error)), eof=True)
        except ConnectionError:  # the client is gone: nothing to tell it (the caller aborts the request)
            pass
        return resp
