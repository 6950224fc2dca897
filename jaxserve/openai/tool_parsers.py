"""Tool-call parsers: one choice's generated text into OpenAI tool-call deltas, as it streams.

- `NamedCall` (tool_choice names a function): the whole output is that function's arguments.
- `ArrayCalls` (tool_choice required): the grammar's JSON array of calls, each call's arguments streamed as they
  are generated.
- `HermesCalls` (tool_choice auto, on a Hermes template: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  as Qwen2.5 / Qwen3 and Hermes templates write them): text outside the tags is content, a block that is not a JSON
  object naming a tool (with object arguments) stays text, and each call is sent once its block is complete (a
  stream cannot take back a call).

A parser's `feed(text)` / `finish()` return chat deltas, each {"content": ...} or {"tool_calls": [one entry]}, a call
first as {index, id, type, function: {name, arguments: ""}}, then {index, function: {arguments: fragment}}, as
OpenAI streams them; `assemble` folds them into a whole message's content and tool_calls.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def is_hermes(chat_template: str | None) -> bool:
    """Whether a chat template writes tool calls in the Hermes format (it spells the tag out)."""
    return chat_template is not None and HERMES_START in chat_template


def tags_are_special(tokenizer, tags: tuple[str, ...] = (HERMES_START, HERMES_END)) -> bool:
    """Whether the tags (default: Hermes's) are special tokens of this vocabulary, which decoding drops unless told
    to keep them (Qwen's are ordinary added tokens; some Hermes models' are special)."""
    return any(tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False)) != tag for tag in tags)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _header(index: int, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _arguments(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class NamedCall:
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        if not self.calls:
            deltas.append(_header(0, self.name))
            self.calls = 1
        if text:
            deltas.append(_arguments(0, text))
        return deltas

    def finish(self) -> list[dict]:
        return self.feed("")


class ArrayCalls:
    """tool_choice required: the output is a JSON array of {"name", "arguments"} objects (the grammar's). A scanner
    follows its structure character by character: each call's header goes out once its name is read, its arguments'
    text as it comes (held back while the name is still to come)."""

    def __init__(self):
        self.calls = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._token = []  # the string or scalar being read at depth 2 (a key, or a value)
        self._key = None  # the key whose value is being read at depth 2
        self._expect_key = False
        self._in_arguments = False  # inside the value of "arguments"
        self._args = []  # its text not yet sent
        self._name = None  # the current element's name, once read
        self._sent_header = False

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        for c in text:
            self._step(c, deltas)
        self._flush_arguments(deltas)
        return deltas

    def finish(self) -> list[dict]:
        return []

    def _flush_arguments(self, deltas: list) -> None:
        if self._sent_header and self._args:
            deltas.append(_arguments(self.calls - 1, "".join(self._args)))
            self._args = []

    def _step(self, c: str, deltas: list) -> None:
        depth = self._depth
        if self._in_arguments:
            self._args.append(c)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if depth == 2:
                    self._end_token(c, deltas)
                    return
            if depth == 2:
                self._token.append(c)
            return
        if c.isspace():
            return
        if depth == 2 and self._token and c in ",}":  # a scalar value ends
            self._end_token(None, deltas)
        if c == '"':
            self._in_string = True
            if depth == 2:
                self._token = [c]
                if not self._expect_key:
                    self._start_value(c)
        elif c in "{[":
            self._depth += 1
            if depth == 1:  # a call begins
                self._name, self._sent_header, self._expect_key = None, False, True
            elif depth == 2:
                self._start_value(c)
        elif c in "}]":
            self._depth -= 1
            if depth == 3 and self._in_arguments:
                self._end_arguments(deltas)
        elif c == ":" and depth == 2:
            self._expect_key = False
        elif c == "," and depth == 2:
            self._expect_key = True
        elif depth == 2 and not self._expect_key:  # a number, true, false or null
            if not self._token:
                self._start_value(c)
            self._token.append(c)

    def _start_value(self, c: str) -> None:
        if self._key == "arguments" and not self._in_arguments:
            self._in_arguments = True
            self._args = [c]

    def _end_token(self, last: str | None, deltas: list) -> None:
        if last is not None:
            self._token.append(last)
        token, self._token = "".join(self._token), []
        if self._expect_key:
            self._key = json.loads(token)
            return
        if self._key == "name":
            self._name = json.loads(token)
            self.calls += 1
            deltas.append(_header(self.calls - 1, self._name))
            self._sent_header = True
            self._flush_arguments(deltas)
        elif self._in_arguments:  # a string or scalar argument value
            if last is None:
                self._args.pop()  # the delimiter after a scalar is not part of it
            self._end_arguments(deltas)

    def _end_arguments(self, deltas: list) -> None:
        self._in_arguments = False
        self._flush_arguments(deltas)
        self._key = None


class HermesCalls:
    """tool_choice auto on a Hermes template: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in
    the text. Whitespace between content and a call, and between calls, is not content. Without
    parallel_tool_calls only the first call is kept (what follows it is dropped). `functions`: the request's
    tools by name (only the names are read)."""

    def __init__(self, functions: Mapping[str, object], parallel: bool = True):
        self.functions, self.parallel = functions, parallel
        self.calls = 0
        self._text = ""  # held back: a possible start tag, trailing whitespace, or an open block
        self._in_block = False
        self._after_call = False
        self._gap = ""  # the whitespace before the open block
        self._done = False

    def feed(self, text: str) -> list[dict]:
        if self._done:
            return []
        self._text += text
        deltas: list[dict] = []
        while True:
            if self._in_block:
                end = self._text.find(HERMES_END)
                if end < 0:
                    return deltas
                self._close_block(self._text[:end], deltas)
                self._text = self._text[end + len(HERMES_END):]
                if self._done:
                    return deltas
                continue
            if self._after_call:
                self._text = self._text.lstrip()
                if not self._text:
                    return deltas
                self._after_call = False
            start = self._text.find(HERMES_START)
            if start >= 0:
                before = self._text[:start].rstrip()
                self._content(before, deltas)
                self._gap = self._text[len(before):start]  # text again if the block is no call
                self._text, self._in_block = self._text[start + len(HERMES_START):], True
                continue
            # Send what cannot begin a tag; hold back trailing whitespace (it may precede one) and a partial tag.
            keep = len(self._text) - len(self._text.rstrip())
            for k in range(min(len(HERMES_START) - 1, len(self._text)), 0, -1):
                if HERMES_START.startswith(self._text[-k:]):
                    keep = max(keep, len(self._text) - len(self._text[:-k].rstrip()))
                    break
            self._content(self._text[:len(self._text) - keep], deltas)
            self._text = self._text[len(self._text) - keep:]
            return deltas

    def finish(self) -> list[dict]:
        deltas: list[dict] = []
        if self._done:
            return deltas
        if self._in_block:  # the output ended inside a block: a call if what came is one, else text
            self._close_block(self._text, deltas, closed=False)
        else:
            self._content(self._text, deltas)
        self._text = ""
        return deltas

    def _content(self, text: str, deltas: list) -> None:
        if text:
            deltas.append({"content": text})

    def _close_block(self, block: str, deltas: list, closed: bool = True) -> None:
        self._in_block = False
        call = self._call(block)
        if call is None:
            self._content(self._gap + HERMES_START + block + (HERMES_END if closed else ""), deltas)
            return
        name, arguments = call
        deltas += [_header(self.calls, name), _arguments(self.calls, arguments)]
        self.calls += 1
        self._after_call = True
        self._done = not self.parallel

    def _call(self, block: str) -> tuple[str, str] | None:
        # RecursionError: JSON nested past Python's recursion limit (a model can write "[" a thousand times) is
        # text like any other block that is no call.
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(obj, dict) and set(obj) <= {"name", "arguments"} and obj.get("name") in self.functions):
            return None
        arguments = obj.get("arguments", {})
        try:
            if isinstance(arguments, str):  # some models write the arguments as JSON text
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                return None
            return obj["name"], json.dumps(arguments, ensure_ascii=False)
        except (ValueError, RecursionError):
            return None


def assemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """A whole message from a choice's deltas: (content, or None when there is none; tool_calls)."""
    content, calls = [], []
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for entry in d.get("tool_calls", []):
            if "id" in entry:
                calls.append({"id": entry["id"], "type": "function",
                              "function": {"name": entry["function"]["name"], "arguments": ""}})
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    text = "".join(content)
    return (text or None) if calls else text, calls
