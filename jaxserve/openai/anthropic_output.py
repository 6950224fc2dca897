"""Anthropic's Messages API, the answer's side: the chat path's deltas for one choice (its text, and its tool calls as
the chat path's parser made them) turned into Anthropic content blocks, whole or as the stream's events. Pure
functions and one builder, no HTTP: `jaxserve.server.messages` moves the bytes.

The stream, as Anthropic sends it: message_start, ping, then per block content_block_start, its deltas (text_delta,
input_json_delta, thinking_delta) and content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and
message_stop; each an `event:` line and a `data:` line.

Reasoning: the chat path splits it from the answer (the served model's --reasoning-parser, `jaxserve.openai.reasoning`)
into `reasoning_content` deltas, before its tool-call parser reads the answer; they become thinking blocks when the
request asked for them (`thinking` enabled or adaptive), and are dropped otherwise, as Anthropic returns no thinking
unasked.
"""
from __future__ import annotations

import json
import uuid

from jaxserve.openai.tool_parsers import new_call_id

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str | None) -> str:
    """A chat tool call's id as Anthropic spells them (toolu_...)."""
    return "toolu_" + (call_id or new_call_id()).removeprefix("call_")


def stop_reason(finish_reason: str | None, stopped_by) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason; stopped_by: the stop string or token id that ended it
    (CompletionOutput.stop_reason)."""
    if finish_reason == "stop" and isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those served from the
    prefix cache (their sum is the prompt, as count_tokens counts it); nothing is written to a cache on request."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"


def message_body(message_id: str, model: str, content: list[dict], stop: tuple[str | None, str | None],
                 usage_: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}


class MessageBuilder:
    """One answer's content blocks, built from the chat path's deltas as they come; each step returns the stream
    events that carry what it added (a whole answer ignores them and reads `content()`)."""

    def __init__(self, show_thinking: bool = False):
        """show_thinking: the reasoning_content deltas as thinking blocks (else dropped)."""
        self.show_thinking = show_thinking
        self.blocks: list[dict] = []
        self._args: dict[int, str] = {}  # a tool_use block's arguments, as JSON text so far
        self._open = False

    def feed(self, delta: dict) -> bytes:
        """Events for one chat delta: {"content"}, {"reasoning_content"} or {"tool_calls": [entry]}."""
        out = [self._thinking(delta.get("reasoning_content") or ""), self._text(delta.get("content") or "")]
        for entry in delta.get("tool_calls") or []:
            fn = entry.get("function") or {}
            if entry.get("id") is not None:  # a new call
                out.append(self._start({"type": "tool_use", "id": tool_use_id(entry["id"]), "name": fn["name"],
                                        "input": {}}))
                self._args[len(self.blocks) - 1] = ""
            if fn.get("arguments"):
                self._args[len(self.blocks) - 1] += fn["arguments"]
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return b"".join(out)

    def finish(self) -> bytes:
        """The last block's end (the chat path flushed what its parsers held back with the last delta)."""
        return self._stop()

    def content(self) -> list[dict]:
        """The blocks, each tool_use's input parsed (arguments cut short by max_tokens: {}, as nothing can be read
        from them for certain)."""
        blocks = [dict(b) for b in self.blocks]
        for i, text in self._args.items():
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            blocks[i]["input"] = parsed if isinstance(parsed, dict) else {}
        return blocks

    def _thinking(self, text: str) -> bytes:
        if not (text and self.show_thinking):
            return b""
        start = b"" if self._last("thinking") else self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += text
        return start + self._delta({"type": "thinking_delta", "thinking": text})

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        start = b"" if self._last("text") else self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += text
        return start + self._delta({"type": "text_delta", "text": text})

    def _last(self, kind: str) -> bool:
        return self._open and self.blocks[-1]["type"] == kind

    def _start(self, block: dict) -> bytes:
        stop = self._stop()
        self.blocks.append(block)
        self._open = True
        return stop + event("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                              "delta": delta})

    def _stop(self) -> bytes:
        if not self._open:
            return b""
        self._open = False
        return event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
