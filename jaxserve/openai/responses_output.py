"""OpenAI's Responses API, the answer's side: the chat path's stream deltas ({"content"}, {"tool_calls"},
{"reasoning_content"}) turned into Responses output items (reasoning, message, function_call) and the typed stream
events that build them, each with its sequence_number. A whole answer is the same events unsent: one builder for
both, so they cannot disagree.

Reasoning: where the server has a reasoning parser (--reasoning-parser), the chat path splits the reasoning from the
answer (`jaxserve.openai.reasoning`) before its tool-call parser reads the answer; its reasoning_content deltas
become a reasoning item before the answer's message and calls.
"""
from __future__ import annotations

import time
import uuid


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_body(response_id: str, model: str, body: dict) -> dict:
    """The response object before any output, echoing what the request set (as OpenAI's does)."""
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    tools = [{"strict": True, "description": None, "parameters": None, **t} for t in body.get("tools") or []]
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store") is not False, "temperature": body.get("temperature"),
            "text": {"format": text_format}, "tool_choice": body.get("tool_choice") or "auto", "tools": tools,
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": None, "user": body.get("user"),
            "metadata": body.get("metadata") or {}, "background": False}


class ResponseBuilder:
    """One response's output as the chat deltas come: `feed` and `finish` return the stream events (dicts) that
    say what changed; `body` is the response object (whole once finished)."""

    def __init__(self, body: dict):
        """body: response_body(...)."""
        self.body = body
        self.sequence = 0
        self.open: dict | None = None  # the output item being written (its text or arguments still growing)
        self.calls: dict[int, dict] = {}  # the chat tool call index -> its function_call item
        self.reasoning_text = ""  # all of it: what the reasoning tokens are counted from

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=dict(self.body)),
                self.event("response.in_progress", response=dict(self.body))]

    def feed(self, delta: dict) -> list[dict]:
        """One chat delta -> its events."""
        events: list[dict] = []
        self._write(delta.get("reasoning_content") or "", delta.get("content") or "", events)
        for entry in delta.get("tool_calls") or []:
            self._call(entry, events)
        return events

    def finish(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        """The last events: open items closed (an empty message if nothing came), the response completed (or
        incomplete: max_output_tokens reached)."""
        events: list[dict] = []
        if not self.body["output"]:
            self._open_message(events)
        self._close(events)
        self.body["usage"] = usage_
        if finish_reason == "length":
            self.body["status"], self.body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            events.append(self.event("response.incomplete", response=self.body))
        else:
            self.body["status"] = "completed"
            events.append(self.event("response.completed", response=self.body))
        return events

    def _write(self, reasoning: str, answer: str, events: list) -> None:
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                self._close(events)
                self._add({"id": item_id("rs"), "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}, events)
            assert self.open is not None  # opened above
            self.open["content"][0]["text"] += reasoning
            self.reasoning_text += reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=reasoning))
        if answer:
            if self.open is None or self.open["type"] != "message":
                self._open_message(events)
            assert self.open is not None  # opened above
            self.open["content"][0]["text"] += answer
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=answer, logprobs=[]))

    def _open_message(self, events: list) -> None:
        self._close(events)
        self._add({"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                   "content": []}, events)
        assert self.open is not None
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=self._index(),
                                 content_index=0, part=dict(part)))

    def _call(self, entry: dict, events: list) -> None:
        """A chat tool-call delta: its first opens a function_call item, the rest add to its arguments."""
        if "id" in entry:
            self._close(events)
            item = {"id": item_id("fc"), "type": "function_call", "call_id": entry["id"],
                    "name": entry["function"]["name"], "arguments": "", "status": "in_progress"}
            self.calls[entry["index"]] = item
            self._add(item, events)
        fragment = entry["function"].get("arguments") or ""
        item = self.calls[entry["index"]]
        if fragment:
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self._index(item), delta=fragment))

    def _add(self, item: dict, events: list) -> None:
        self.body["output"].append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=self._index(), item=_copy(item)))

    def _index(self, item: dict | None = None) -> int:
        target = item or self.open
        return next(i for i, x in enumerate(self.body["output"]) if x is target)

    def _close(self, events: list) -> None:
        """Ends the open item: its done events, in the order OpenAI sends them."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self._index(item)}
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                     logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))


def _copy(item: dict) -> dict:
    """An item as it stands now (its content parts copied: they grow after the event is built)."""
    return {**item, **({"content": [dict(p) for p in item["content"]]} if "content" in item else {})}
