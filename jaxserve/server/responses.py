"""A request's engine outputs turned into its HTTP response: whole (one JSON body) or streamed (server-sent events),
per choice its text, tokens, logprobs and timing, and the model's latency metrics as they come."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any

from aiohttp import web

from jaxserve.engine.client import EngineDeadError
from jaxserve.openai.answer_size import encode_json
from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import json_bytes_response, write_stream
from jaxserve.openai.reasoning import ThinkParser, reasoning_fields
from jaxserve.openai.responses import (
    chat_logprobs,
    completion_body,
    completion_logprobs,
    echo_logprobs,
    new_id,
    prompt_logprobs_body,
    usage,
)
from jaxserve.openai.tool_calls import ToolRequest
from jaxserve.openai.tool_parsers import assemble
from jaxserve.server.served_model import ServedModel

logger = logging.getLogger("jaxserve")


async def merged(streams):
    """(k, output) from several requests' output iterators as they come; each is closed (= aborted if unfinished)
    when this is."""
    async with contextlib.AsyncExitStack() as stack:
        for s in streams:
            await stack.enter_async_context(contextlib.aclosing(s))
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k, s):
            try:
                async for out in s:
                    queue.put_nowait((k, out))
                queue.put_nowait((k, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader
                queue.put_nowait((k, e))

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                k, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield k, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def answered_off_loop(model: ServedModel, fn, *args) -> web.Response:
    """fn(*args), a JSON answer, built and encoded on the model's tokenizing threads (a tokenizer endpoint's: within
    an admission of one)."""
    return json_bytes_response(await model.off_loop(1, lambda: encode_json(fn(*args))))


class CompletionResponse:
    """One request's outputs as they come: per choice its text, tokens and timing, and the bodies built from them."""

    def __init__(self, model: ServedModel, body: dict, params, chat: bool, num_prompts: int = 1,
                 stream_write_timeout_s: float = 30.0, tools: ToolRequest | None = None, name: str | None = None):
        """name: the model the answer names (the request's adapter, else the served model's name)."""
        self.model, self.params, self.chat = model, params, chat
        self.name = name or model.name
        self.stream_write_timeout_s = stream_write_timeout_s
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.arrival = time.monotonic()
        self.first_token_seen = False
        self.top = body.get("top_logprobs") or 0
        # Completions' echo (the prompt before each choice's text and logprobs) and vLLM's prompt_logprobs: per
        # prompt its token ids, text and scores, from its first output.
        self.echo = not chat and body.get("echo") is True
        self.show_prompt_logprobs = body.get("prompt_logprobs")
        self.sent_prompt_logprobs = False  # a chat stream's, in its first chunk
        # Logprobs are what make an answer large (see jaxserve.openai.answer_size): such an answer is built and encoded
        # on the model's responding threads, so the event loop serves everyone else (/health too) meanwhile.
        self.heavy = params.logprobs is not None or params.prompt_logprobs is not None
        self.prompts: list = [None] * num_prompts  # (token ids, text, scores) per prompt
        self.started: set[int] = set()  # choices whose first chunk has gone out (with the prompt, if asked)
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts  # of those, served from the prefix cache (each prompt's latest count)
        choices = params.n * num_prompts
        self.text = [""] * choices
        self.text_offset = [0] * choices  # completions logprobs: where the next token's text starts
        self.tokens = [0] * choices
        self.last_token_at = [None] * choices
        self.finish = [None] * choices
        self.logprobs: list[list[dict]] = [[] for _ in range(choices)]
        # Tool calls: each choice's text goes through its own parser (None: plain content), its deltas kept for a
        # whole response.
        self.parsers = [None] * choices
        if tools is not None:
            self.parsers = [model.tool_parser(tools) for _ in range(choices)]
        self.deltas: list[list[dict]] = [[] for _ in range(choices)]
        # Reasoning (a chat answer of a model served with --reasoning-parser): each choice's parser, made with its
        # first delta (when the prompt is known: it may have closed the block), and its reasoning text.
        self.reasoners: list[ThinkParser | None] = [None] * choices
        self.reasoning = [""] * choices
        self.headers: dict = {}  # of the response (a decode server's KV fetch report)
        self.handed_off = None  # a prefill server's: the HandOff its engine ended the request with

    def check_size(self, prompts: list[dict]) -> None:
        """A 400 if the answer to these (tokenized) prompts could hold more logprobs than the server gives one
        request: checked before they are submitted."""
        limits = self.model.logprob_limits
        limits.check_counts(self.params, self.chat)
        limits.check_entries([len(p["prompt_token_ids"]) for p in prompts], self.params, chat=self.chat,
                             echo=self.echo, shown_prompt_logprobs=self.show_prompt_logprobs,
                             max_model_len=self.model.engine.max_model_len)

    async def _built(self, fn, *args):
        """fn(*args): a heavy answer's on the model's responding threads (within the request's admission, as the
        tokenizing threads' work), a light one's here."""
        if not self.heavy:
            return fn(*args)
        return await self.model.off_loop(len(self.text), fn, *args, pool=self.model.responding)

    def _token_text(self, token_id: int) -> str:
        tok = self.model.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    def _logprobs(self, out, offset: int):
        if self.chat:
            tok = self.model.tokenizer
            return chat_logprobs(out, self._token_text, self.top, tok.token_bytes if tok is not None else None)
        return completion_logprobs(out, self._token_text, offset)

    async def _each(self, outputs):
        """Yields (choice index, CompletionOutput delta) for each new piece, after recording it (metrics too)."""
        metrics = self.model.metrics
        try:
            async for k, out in outputs:
                now = time.monotonic()
                self.prompt_tokens[k] = len(out.prompt_token_ids)
                if out.num_cached_tokens is not None:
                    self.cached_tokens[k] = out.num_cached_tokens
                if self.prompts[k] is None:  # the first output of a request carries its prompt logprobs, if asked
                    self.prompts[k] = (out.prompt_token_ids, out.prompt, out.prompt_logprobs)
                if not self.first_token_seen and any(c.token_ids for c in out.outputs):
                    # When it happens (as vLLM), so a request aborted later still counts; from the server's receipt.
                    self.first_token_seen = True
                    metrics.ttft.observe(now - self.arrival)
                for c in out.outputs:
                    i = k * self.params.n + c.index
                    if c.token_ids and self.last_token_at[i] is not None:
                        metrics.itl.observe(now - self.last_token_at[i])
                    if c.token_ids:
                        self.last_token_at[i] = now
                    self.tokens[i] += len(c.token_ids)
                    if c.finish_reason is not None:
                        self.finish[i] = c.finish_reason
                        metrics.finished(c.finish_reason)
                    yield i, c
                if out.handed_off is not None:
                    self.handed_off = out.handed_off
                if out.finished and out.metrics is not None:
                    metrics.observe_request(out.metrics)
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed engine step fails this request only
            raise ApiError(500, f"generation failed: {type(e).__name__}: {e}") from None

    def _usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(self.tokens), sum(self.cached_tokens))

    def _echo(self, i: int) -> tuple[str, dict | None]:
        """Choice i's prompt, echoed: its text (a token-id prompt's decoded) and, with logprobs, theirs; the text
        offsets of the completion's tokens then start after the prompt's."""
        ids, text, scored = self.prompts[i // self.params.n]
        if text is None:
            tok = self.model.tokenizer
            text = tok.decode(ids, skip_special_tokens=False) if tok is not None else ""
        lp = None
        if self.params.logprobs is not None:
            lp = echo_logprobs(ids, scored, self._token_text, self.params.logprobs)
            self.text_offset[i] = sum(map(len, lp["tokens"]))
        return text, lp

    def _choices(self, i: int, c) -> list[dict]:
        """The chunk (stream) entries of choice i for the delta c: one, or for tool calls one per delta the parser
        makes of it (its logprobs on the first, its finish_reason on the last); with echo, the first holds the
        prompt."""
        prefix, prefix_lp, first = "", None, i not in self.started
        self.started.add(i)
        if self.echo and first:
            prefix, prefix_lp = self._echo(i)
        lp = self._logprobs(c, self.text_offset[i])
        if lp is not None and not self.chat:  # each token's own text, sent or still held back from the stream
            self.text_offset[i] += sum(map(len, lp["tokens"]))
        if prefix_lp is not None:  # the prompt's were counted by _echo
            lp = merge_logprobs([prefix_lp, lp])
        c = dataclasses.replace(c, text=prefix + c.text) if prefix else c
        thought = ""
        if self.chat and self.model.reasoning_parser is not None:  # the answer goes on; the reasoning apart
            thought, answer = self._split(i, c.text, c.finish_reason is not None)
            c = dataclasses.replace(c, text=answer)
        self.text[i] += c.text
        if not self.chat:
            choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            if first and self.show_prompt_logprobs is not None:  # vLLM's, per choice (streamed: in its first chunk)
                choice["prompt_logprobs"] = self._prompt_logprobs(i // self.params.n)
            return [choice]
        parser, reasoner = self.parsers[i], self.reasoners[i]
        deltas: list[dict] = []
        if parser is None:
            deltas = [{"content": c.text}] if c.text else []
        elif c.text or c.finish_reason is not None or reasoner is None or reasoner.ended:
            # (not while the reasoning goes on: a named call's header would come before the reasoning's end)
            deltas = parser.feed(c.text) + (parser.finish() if c.finish_reason is not None else [])
            self.deltas[i] += deltas
        if thought:  # before the answer's deltas: its text came first
            deltas = [reasoning_fields(thought), *deltas]
        entries: list[dict[str, Any]] = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}
                                         for d in deltas or [{}]]
        entries[0]["logprobs"] = lp
        entries[-1]["finish_reason"] = self._finish_reason(i, c.finish_reason)
        return entries

    async def chat_deltas(self, outputs):
        """(choice, its chat chunk entries, the CompletionOutput delta) for each new piece, as a chat stream would send
        them (reasoning split, tool calls parsed): what another API's answer (Anthropic's Messages, OpenAI's Responses)
        is built from, so that it shares the chat path's parsing, grammars, accounting and metrics."""
        async for i, c in self._each(outputs):
            yield i, self._choices(i, c), c

    def _split(self, i: int, text: str, last: bool) -> tuple[str, str]:
        """Choice i's new text as (reasoning, answer), through its reasoning parser."""
        reasoner = self.reasoners[i]
        if reasoner is None:
            kind = self.model.reasoning_parser
            assert kind is not None  # (called only then)
            reasoner = self.reasoners[i] = kind(kind.prompt_ends_reasoning(self.prompts[i // self.params.n][1] or ""))
        thought, answer = reasoner.feed(text)
        if last:
            more_thought, more_answer = reasoner.finish()
            thought, answer = thought + more_thought, answer + more_answer
        self.reasoning[i] += thought
        return thought, answer

    def _finish_reason(self, i: int, reason: str | None) -> str | None:
        """A choice that called tools and stopped by itself (or by its grammar's end) ends with "tool_calls"."""
        parser = self.parsers[i]
        return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason

    def _prompt_logprobs(self, k: int) -> list | None:
        """vLLM's prompt_logprobs of prompt k, as the request asked them."""
        if self.show_prompt_logprobs is None or self.prompts[k] is None:
            return None
        ids, _, scored = self.prompts[k]
        return prompt_logprobs_body(ids, scored, self.show_prompt_logprobs)

    async def whole(self, outputs) -> web.Response:
        return await self.respond(await self.whole_body(outputs))

    async def respond(self, body: dict) -> web.Response:
        """The whole answer `body` as a JSON response (a heavy one encoded off the event loop)."""
        data = await self._built(encode_json, body) if self.heavy else json.dumps(body).encode()
        return json_bytes_response(data, self.headers)

    async def whole_body(self, outputs) -> dict:
        deltas = [(i, c) async for i, c in self._each(outputs)]
        return await self._built(self._whole_body, deltas)

    def _whole_body(self, deltas: list) -> dict:
        for i, c in deltas:
            lp = self._choices(i, c)[0]["logprobs"]
            if lp is not None:
                self.logprobs[i].append(lp)
        choices = []
        for i in range(len(self.text)):
            lp = merge_logprobs(self.logprobs[i]) if self.params.logprobs is not None else None
            finish = self._finish_reason(i, self.finish[i])
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": self.text[i]}
                if self.parsers[i] is not None:
                    message["content"], calls = assemble(self.deltas[i])
                    if calls:
                        message["tool_calls"] = calls
                if self.model.reasoning_parser is not None:
                    message.update(reasoning_fields(self.reasoning[i] or None))
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": lp, "finish_reason": finish})
                if self.show_prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(i // self.params.n)
        body = completion_body(self.id, self.name, choices, self._usage(), self.chat, chunk=False)
        if self.chat and self.show_prompt_logprobs is not None:  # vLLM's chat response holds them at its top
            body["prompt_logprobs"] = self._prompt_logprobs(0)
        return body

    def _events(self, i: int, c, large: bool = False) -> bytes:
        """The stream events of choice i's delta c; `large` (one carrying the prompt's logprobs): encoded in pieces
        (encode_json), the rest by one json.dumps (cheaper for a token's worth)."""
        events = []
        for entry in self._choices(i, c):
            chunk = completion_body(self.id, self.name, [entry], None, self.chat, chunk=True)
            if self.chat and self.show_prompt_logprobs is not None and not self.sent_prompt_logprobs:
                chunk["prompt_logprobs"] = self._prompt_logprobs(0)  # once, in the first chunk
                self.sent_prompt_logprobs = True
            events.append(b"data: " + (encode_json(chunk) if large else json.dumps(chunk).encode()) + b"\n\n")
        return b"".join(events)

    async def stream(self, request, outputs, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self.headers})
        await resp.prepare(request)
        name = self.name

        async def write(data: bytes, eof: bool = False) -> None:
            await write_stream(request, resp, data, self.stream_write_timeout_s, eof)

        async def send(body) -> None:
            await write(b"data: " + json.dumps(body).encode() + b"\n\n")

        try:
            try:
                if self.chat:  # the role first, as OpenAI sends it
                    role = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(len(self.text))]
                    await send(completion_body(self.id, name, role, None, True, chunk=True))
                async for i, c in self._each(outputs):
                    # A choice's first delta carries the prompt (echo, prompt_logprobs): with logprobs, its bulk
                    # is built off the event loop, as a whole answer's.
                    if i not in self.started and (self.echo or self.show_prompt_logprobs is not None):
                        await write(await self._built(self._events, i, c, True))
                    else:
                        await write(self._events(i, c))
                if include_usage:
                    await send(completion_body(self.id, name, [], self._usage(), self.chat, chunk=True))
            except ConnectionError:
                raise  # below: nothing to tell a client that is gone
            except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream, as vLLM's
                if not isinstance(e, ApiError):
                    logger.exception("streaming %s failed", self.id)
                    e = ApiError(500, f"internal server error: {type(e).__name__}")
                await send(e.body())
            await write(b"data: [DONE]\n\n", eof=True)
        except ConnectionError:  # the client is gone: nothing to tell it (the caller aborts the request)
            pass
        return resp


def merge_logprobs(parts: list[dict]) -> dict | None:
    """Per-delta logprobs objects -> one (lists concatenated)."""
    if not parts:
        return None
    merged: dict[str, list] = {k: [] for k in parts[0]}
    for part in parts:
        for k, v in part.items():
            merged[k] += v
    return merged
