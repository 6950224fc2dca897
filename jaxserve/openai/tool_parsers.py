"""Tool-call parsers: one choice's generated text into OpenAI tool-call deltas, as it streams.

- `NamedCall` (tool_choice names a function): the whole output is that function's arguments.
- `ArrayCalls` (tool_choice required): the grammar's JSON array of calls, each call's arguments streamed as they
  are generated.
- `HermesCalls` (tool_choice auto, on a Hermes template: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  as Qwen2.5 / Qwen3 and Hermes templates write them): text outside the tags is content, a block that is not a JSON
  object naming a tool (with object arguments) stays text, and each call is sent once its block is complete (a
  stream cannot take back a call). `BlockCalls` is its streaming over blocks, shared with the other formats
  (jaxserve.openai.tool_call_parsers lists them all).

A parser's `feed(text)` / `finish()` return chat deltas, each {"content": ...} or {"tool_calls": [one entry]}, a call
first as {index, id, type, function: {name, arguments: ""}}, then {index, function: {arguments: fragment}}, as
OpenAI streams them; `assemble` folds them into a whole message's content and tool_calls.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def tags_are_special(tokenizer, tags: tuple[str, ...] = (HERMES_START, HERMES_END)) -> bool:
    """Whether a format's tags are special tokens of this vocabulary, which decoding drops unless told to keep
    them (Qwen's are ordinary added tokens; some Hermes models' are special, as are Mistral's [TOOL_CALLS] and
    Llama's <|python_tag|>)."""
    return any(tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False)) != tag for tag in tags)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def header_delta(index: int, name: str, call_id: str | None = None) -> dict:
    """A call's first stream entry: its index, its id (default: a new one), its type and name, and empty
    arguments."""
    return {"tool_calls": [{"index": index, "id": call_id or new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class NamedCall:
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def feed(self, text: str) -> list[dict]:
        deltas: list[dict] = []
        if not self.calls:
            deltas.append(header_delta(0, self.name))
            self.calls = 1
        if text:
            deltas.append(arguments_delta(0, text))
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
            deltas.append(arguments_delta(self.calls - 1, "".join(self._args)))
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
            deltas.append(header_delta(self.calls - 1, self._name))
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


class BlockCalls:
    """Content with calls in blocks that open with `START` (a subclass reads where a block ends and what calls it
    holds: `read_block`). Whitespace between content and a call, and between calls, is not content. A block that is
    no call stays text, as it came; each call is sent once its block is complete (a stream cannot take back a
    call). Without parallel_tool_calls only the first call is kept (what follows it is dropped). `functions`: the
    request's tools by name."""

    START = ""
    TAGS: tuple[str, ...] = ()  # the format's markers: kept in the text where they are special tokens

    @staticmethod
    def new_id() -> str:
        """A new call's id, in the format's family's own shape."""
        return new_call_id()

    def __init__(self, functions: Mapping[str, object], parallel: bool = True):
        self.functions, self.parallel = functions, parallel
        self.calls = 0
        self._text = ""  # held back: a possible start tag, trailing whitespace, or an open block
        self._in_block = False
        self._after_call = False
        self._gap = ""  # the whitespace before the open block
        self._done = False

    def read_block(self, text: str, final: bool) -> tuple[int, list[tuple[str, str]] | None] | None:
        """The open block's text so far (after START) -> None while it may go on (never when `final`: the output
        has ended), else (where it ends in `text`, its calls as (name, arguments JSON text), or None: no call)."""
        raise NotImplementedError

    def feed(self, text: str) -> list[dict]:
        if self._done:
            return []
        self._text += text
        deltas: list[dict] = []
        while True:
            if self._in_block:
                block = self.read_block(self._text, final=False)
                if block is None:
                    return deltas
                self._close_block(block, deltas)
                if self._done:
                    return deltas
                continue
            if self._after_call:
                self._text = self._text.lstrip()
                if not self._text:
                    return deltas
                self._after_call = False
            start = self._text.find(self.START)
            if start >= 0:
                before = self._text[:start].rstrip()
                self._content(before, deltas)
                self._gap = self._text[len(before):start]  # text again if the block is no call
                self._text, self._in_block = self._text[start + len(self.START):], True
                continue
            # Send what cannot begin a tag; hold back trailing whitespace (it may precede one) and a partial tag.
            keep = len(self._text) - len(self._text.rstrip())
            for k in range(min(len(self.START) - 1, len(self._text)), 0, -1):
                if self.START.startswith(self._text[-k:]):
                    keep = max(keep, len(self._text) - len(self._text[:-k].rstrip()))
                    break
            self._content(self._text[:len(self._text) - keep], deltas)
            self._text = self._text[len(self._text) - keep:]
            return deltas

    def finish(self) -> list[dict]:
        deltas: list[dict] = []
        while self._in_block and not self._done:  # the output ended inside a block: calls if what came is, else text
            block = self.read_block(self._text, final=True)
            assert block is not None  # final: a block always ends
            self._close_block(block, deltas)
            deltas += self.feed("")
        if not self._done:
            self._content(self._text.lstrip() if self._after_call else self._text, deltas)
        self._text = ""
        return deltas

    def _content(self, text: str, deltas: list) -> None:
        if text:
            deltas.append({"content": text})

    def _close_block(self, block: tuple[int, list | None], deltas: list) -> None:
        end, calls = block
        text, self._text = self._text[:end], self._text[end:]
        self._in_block = False
        if calls is None:
            self._content(self._gap + self.START + text, deltas)
            return
        for name, arguments in calls[:len(calls) if self.parallel else 1]:
            deltas += [header_delta(self.calls, name, self.new_id()), arguments_delta(self.calls, arguments)]
            self.calls += 1
        self._after_call = True
        self._done = not self.parallel


class HermesCalls(BlockCalls):
    """tool_choice auto on a Hermes template: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in
    the text (Qwen2.5, Qwen3, Hermes). A block that is not a JSON object naming a tool (with object arguments) is
    text; a block still open when the output ends is a call if what came is one."""

    START, END = HERMES_START, HERMES_END
    TAGS = (HERMES_START, HERMES_END)

    _searched = 0  # how far the open block has no end tag (a search per delta from its start would be quadratic)

    def read_block(self, text: str, final: bool):
        end = text.find(self.END, self._searched)
        if end < 0 and not final:
            self._searched = max(0, len(text) - len(self.END) + 1)
            return None
        self._searched = 0
        if end < 0:
            return len(text), self.parse_block(text)
        return end + len(self.END), self.parse_block(text[:end])

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        """A whole block's calls (None: it is no call)."""
        obj = loads(block)
        if not (names_tool(obj, self.functions) and set(obj) <= {"name", "arguments"}):
            return None
        arguments = json_arguments(obj.get("arguments", {}))
        return None if arguments is None else [(obj["name"], arguments)]


_NOTHING = object()


def loads(text: str):
    """json.loads, or a sentinel no call matches where the text is not JSON. RecursionError: JSON nested past
    Python's recursion limit (a model can write "[" a thousand times) is text like any other that is no JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOTHING


def names_tool(obj, functions: Mapping[str, object]) -> bool:
    """Whether a parsed call is an object whose name is one of the tools (a name that is a list or an object, which
    no dict lookup takes, is none)."""
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in functions


def json_arguments(arguments) -> str | None:
    """A call's arguments as JSON text: an object, or JSON text of one (some models write that); None: neither."""
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


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
