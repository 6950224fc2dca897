"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat completions path. A request
becomes the chat request it means (`jaxserve.openai.responses_api`), is admitted, rendered, run and its tool calls
parsed exactly as a chat completion's, and the chat deltas become Responses output items and typed events
(`jaxserve.openai.responses_output`). Stored responses (`jaxserve.openai.responses_store`) are continued by
previous_response_id and read back by GET."""
from __future__ import annotations

import json
import logging

from aiohttp import web

from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import json_body, write_stream
from jaxserve.openai.requests import parse_chat
from jaxserve.openai.responses_api import chat_error, parse_responses
from jaxserve.openai.responses_output import ResponseBuilder, item_id, response_body, usage
from jaxserve.openai.responses_store import DEFAULT_STORE_SIZE, ResponseStore
from jaxserve.server.responses import CompletionResponse
from jaxserve.server.served_model import ServedModel

logger = logging.getLogger("jaxserve")


class ResponsesRoutes:
    """The Responses API of one Server (its models, admission and engines), with the responses it stores."""

    def __init__(self, server, store_size: int = DEFAULT_STORE_SIZE):
        self.server = server
        self.store = ResponseStore(store_size)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)

    async def retrieve(self, request):
        return web.json_response(self.store.get(request.match_info["response_id"]).body)

    async def create(self, request):
        s = self.server
        req = parse_responses(await json_body(request, s.body_timeout_s))
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, "previous_response_id").conversation
        chat_body = req.chat_body(history)
        m, adapter = s.chat_built_target(chat_body, "/v1/responses")
        try:  # the chat path's 400s name the Responses fields they came from
            builder, answer = await self._answered(request, req, m, adapter, chat_body)
        except ApiError as e:
            raise chat_error(e) from None
        if req.store and builder.body["status"] != "in_progress":
            self.store.put(builder.body, history + req.items + builder.body["output"])
        return answer

    async def _answered(self, request, req, m: ServedModel, adapter, chat_body: dict):
        """Runs the chat request chat_body on model m (its adapter, if any) as the chat route does: (the builder of
        the response, finished; the HTTP answer, a stream already sent)."""
        s = self.server
        messages, params, tools = parse_chat(chat_body)
        params = m.chat_params(params, tools)
        name = adapter.name if adapter is not None else m.name
        with s._admitted(m, 1):
            prompt = await s.chat_prompt(m, messages, params, tools)
            run = CompletionResponse(m, chat_body, params, True, 1, s.stream_write_timeout_s, tools, name)
            builder = ResponseBuilder(response_body(item_id("resp"), name, req.body))
            lora = {"lora_request": adapter.lora_request} if adapter is not None else {}
            async with s.running(m, adapter, run, chat_body, [prompt], params, lora) as outputs:
                if req.stream:
                    answer = await self._stream(request, run, builder, outputs)
                else:
                    async for _ in self._events(m, run, builder, outputs):
                        pass
                    answer = web.json_response(builder.body)
        return builder, answer

    async def _events(self, m: ServedModel, run: CompletionResponse, builder: ResponseBuilder, outputs):
        """The events of the response, a list per chat delta, the last list ending it."""
        finish = None
        async for _, entries, _ in run.chat_deltas(outputs):
            events = []
            for entry in entries:
                finish = entry["finish_reason"] or finish
                events += builder.feed(entry["delta"])
            if events:
                yield events
        reasoning = builder.reasoning_text
        reasoning_tokens = len(m.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        yield builder.finish(finish, usage(sum(run.prompt_tokens), sum(run.tokens), sum(run.cached_tokens),
                                           reasoning_tokens))

    async def _stream(self, request, run: CompletionResponse, builder: ResponseBuilder, outputs):
        """Server-sent events, each `event: TYPE` then its JSON (no [DONE]: response.completed ends it); an error
        after the status line is an `error` event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(events: list[dict], eof: bool = False) -> None:
            data = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                            for e in events)
            await write_stream(request, resp, data, self.server.stream_write_timeout_s, eof)

        try:
            try:
                await send(builder.start())
                async for events in self._events(run.model, run, builder, outputs):
                    await send(events)
            except ConnectionError:
                raise
            except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream
                if not isinstance(e, ApiError):
                    logger.exception("streaming %s failed", builder.body["id"])
                    e = ApiError(500, f"internal server error: {type(e).__name__}")
                await send([builder.event("error", code=e.code, message=e.message, param=e.param)])
            await send([], eof=True)
        except ConnectionError:  # the client is gone (the caller aborts the request)
            pass
        return resp

