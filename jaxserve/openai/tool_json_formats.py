"""Tool calls written as JSON by Llama 3.x and Mistral models (tool_choice auto; vLLM's `llama3_json` and `mistral`
tool-call parsers), as they stream.

- `Llama3JsonCalls`: the output is calls, `{"name": ..., "parameters": {...}}` objects ("arguments" is read too),
  separated by `;`, optionally after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling). An output that
  does not begin with one (whitespace aside) is content, as vLLM streams it.
- `MistralCalls`: `[TOOL_CALLS]` after any content, then either a JSON array of {"name", "arguments"} objects
  (Mistral 7B v0.3 and other tokenizers before v11) or, from v11 on, `name[ARGS]{...}` (`[ARGS]` may be absent where
  the tokenizer drops it), one per `[TOOL_CALLS]`.

As with the Hermes parser (jaxserve.openai.tool_parsers), each call is sent once its JSON is complete, a stream
cannot take back a call: what is not a call (not JSON, a name that is none of the tools, arguments that are no
object, the output ending inside a call) is content, exactly as the model wrote it. vLLM's parsers stream partial
arguments and may send a call they later find broken; here the streamed and the whole answer are always the same.
"""
from __future__ import annotations

import re
import secrets
import string
from collections.abc import Mapping

from jaxserve.openai.tool_parsers import (
    BlockCalls,
    arguments_delta,
    header_delta,
    json_arguments,
    loads,
    names_tool,
)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]{0,64}")
_ALPHANUMERIC = string.ascii_letters + string.digits


class JsonEnd:
    """Where the JSON object or array that begins at `start` of a growing text ends: each character is read once,
    however the text arrives (a rescan per delta would be quadratic in a long call)."""

    def __init__(self, start: int):
        self.pos, self.depth = start, 0
        self.in_string = self.escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the closing bracket, or None while it has not come."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def _lead(text: str) -> int:
    """How much whitespace begins the text."""
    return len(text) - len(text.lstrip())


class Llama3JsonCalls:
    """vLLM's `llama3_json`: see the module's docstring. A first object that is no call makes the whole output
    content (as vLLM answers); after calls, what is not a further call is content."""

    TAGS = (PYTHON_TAG,)

    def __init__(self, functions: Mapping[str, object], parallel: bool = True):
        self.functions, self.parallel = functions, parallel
        self.calls = 0
        self._text = ""  # not sent yet: in "calls", from the end of what was last read
        self._mode = "start"  # start (undecided), calls, content or done
        self._failed = ""  # in "calls": the text read that becomes content if the next object is no call
        self._separated = True  # in "calls": the next object may begin (the output's start, or after a ";")
        self._span: JsonEnd | None = None

    def feed(self, text: str) -> list[dict]:
        if self._mode == "done":
            return []
        self._text += text
        deltas: list[dict] = []
        if self._mode == "start":
            self._start()
        if self._mode == "calls":
            self._read_calls(deltas, final=False)
        if self._mode == "content" and self._text:
            deltas.append({"content": self._text})
            self._text = ""
        return deltas

    def finish(self) -> list[dict]:
        deltas: list[dict] = []
        if self._mode == "calls":
            self._read_calls(deltas, final=True)
        if self._mode in ("start", "content") and self._text:
            deltas.append({"content": self._text})
        self._text, self._mode = "", "done"
        return deltas

    def _start(self) -> None:
        rest = self._text.lstrip()
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            return  # whitespace, or a tag still coming
        if rest.startswith(PYTHON_TAG):
            cut = len(self._text) - len(rest) + len(PYTHON_TAG)
            self._failed, self._text, self._mode = self._text[:cut], self._text[cut:], "calls"
        elif rest.startswith("{"):
            self._mode = "calls"
        else:
            self._mode = "content"

    def _read_calls(self, deltas: list, final: bool) -> None:
        while self._mode == "calls":
            i = _lead(self._text)
            if i == len(self._text):
                if final:
                    self._fail(final)
                return
            if not self._separated:  # after a call: a ";" and the next, or the end
                if self._text[i] != ";":
                    return self._fail(final)
                self._failed += self._text[:i + 1]
                self._text, self._separated = self._text[i + 1:], True
                continue
            if self._text[i] != "{":
                return self._fail(final)
            self._span = self._span or JsonEnd(i)
            end = self._span.end(self._text)
            if end is None:
                if final:
                    self._fail(final)
                return
            self._span = None
            call = self._call(self._text[i:end])
            if call is None:
                return self._fail(final)
            deltas += [header_delta(self.calls, call[0]), arguments_delta(self.calls, call[1])]
            self.calls += 1
            self._text, self._failed, self._separated = self._text[end:], "", False
            if not self.parallel:
                self._mode = "done"

    def _fail(self, final: bool) -> None:
        """What is left is content: all of it before any call, else from the first character that is no call
        (a trailing ";" and whitespace after the calls are nothing)."""
        rest = self._failed + self._text
        if self.calls:
            rest = "" if not rest.strip().strip(";").strip() else rest.lstrip()
        self._text, self._mode, self._span = rest, "content", None

    def _call(self, text: str) -> tuple[str, str] | None:
        obj = loads(text)
        if not (names_tool(obj, self.functions) and set(obj) in ({"name", "parameters"}, {"name", "arguments"})):
            return None
        arguments = json_arguments(obj.get("parameters", obj.get("arguments")))
        return None if arguments is None else (obj["name"], arguments)


class MistralCalls(BlockCalls):
    """vLLM's `mistral`: see the module's docstring. Content before `[TOOL_CALLS]` is content; the array form is
    read as a whole (every element a call, or the block is text)."""

    START = TOOL_CALLS
    TAGS = (TOOL_CALLS, ARGS)

    @staticmethod
    def new_id() -> str:
        """9 letters and digits: Mistral's chat templates (and mistral-common) refuse other ids when the calls come
        back in the next turn, so vLLM makes them so too."""
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def __init__(self, functions: Mapping[str, object], parallel: bool = True):
        super().__init__(functions, parallel)
        self._span: JsonEnd | None = None

    def read_block(self, text: str, final: bool):
        block = self._read(text)
        if block is None and final:
            block = (len(text), None)
        if block is not None:
            self._span = None
        return block

    def _read(self, text: str) -> tuple[int, list | None] | None:
        i = _lead(text)
        if i == len(text):
            return None
        if text[i] == "[":  # before v11: [{"name": ..., "arguments": {...}}, ...]
            end = self._json_end(text, i)
            return None if end is None else (end, self._array_calls(text[i:end]))
        match = _NAME.match(text, i)
        assert match is not None  # (it matches an empty name)
        name = match.group()
        j = i + len(name)
        if text.startswith(ARGS, j):
            j += len(ARGS)
        elif ARGS.startswith(text[j:]):
            return None  # the name or [ARGS] still coming
        if j == len(text):
            return None
        if text[j] != "{" or not name:
            return j, None  # text: the rest of the output is read as content again
        end = self._json_end(text, j)
        if end is None:
            return None
        arguments = json_arguments(loads(text[j:end])) if name in self.functions else None
        return end, None if arguments is None else [(name, arguments)]

    def _json_end(self, text: str, start: int) -> int | None:
        self._span = self._span or JsonEnd(start)
        return self._span.end(text)

    def _array_calls(self, text: str) -> list[tuple[str, str]] | None:
        calls = loads(text)
        if not (isinstance(calls, list) and calls):
            return None
        out = []
        for call in calls:
            if not (names_tool(call, self.functions) and set(call) <= {"name", "arguments", "id"}):
                return None
            arguments = json_arguments(call.get("arguments", {}))
            if arguments is None:
                return None
            out.append((call["name"], arguments))
        return out
