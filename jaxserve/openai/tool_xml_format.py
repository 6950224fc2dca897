"""Tool calls in Qwen3-Coder's XML format (tool_choice auto; vLLM's `qwen3_coder` tool-call parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, turned into the JSON type its tool's `parameters` schema gives it (as vLLM does: an
integer, a number, a boolean, null, an object or array read as JSON or a Python literal; anything that does not
convert, or a parameter the schema does not name, stays a string). The blocks stream as Hermes blocks do
(jaxserve.openai.tool_parsers.HermesCalls: the same tags): a block whose functions are not all tools is text.
"""
from __future__ import annotations

import ast
import json
import math
import re

from jaxserve.openai.tool_parsers import HermesCalls

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
# A value ends at its closing tag, or where the next parameter (or the end) comes without one, as vLLM reads it.
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


class Qwen3CoderCalls(HermesCalls):
    """vLLM's `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`
    (one or more functions a block)."""

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        calls, pos = [], 0
        for m in _FUNCTION.finditer(block):
            if block[pos:m.start()].strip():
                return None
            name = m.group(1).strip()
            function = self.functions.get(name)
            if function is None:
                return None
            properties = getattr(function, "parameters", {}).get("properties")
            properties = properties if isinstance(properties, dict) else {}
            arguments = {}
            for p in _PARAMETER.finditer(m.group(2)):
                key = p.group(1).strip()
                arguments[key] = convert(_trim(p.group(2)), properties.get(key))
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            pos = m.end()
        return calls if calls and not block[pos:].strip() else None


def _trim(value: str) -> str:
    """The newline after the opening tag and the one before the closing tag are layout, not value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _type(schema) -> str:
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the type that is not null
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def convert(value: str, schema):
    """A parameter's text as the JSON value its schema's type asks for (schema None: no such parameter)."""
    if value.lower() == "null":
        return None
    kind = _type(schema)
    if schema is None or kind in _STRING_TYPES:
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    return _structured(value)


def _structured(value: str):
    """An object, array or other type: JSON, else a Python literal (single quotes, True), else the text. Only what
    JSON can hold is taken (a literal may be a set or bytes)."""
    for read in (json.loads, ast.literal_eval):
        try:
            parsed = read(value.strip())
            json.dumps(parsed, allow_nan=False)  # NaN and Infinity are no JSON a client can read
            return parsed
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError):
            continue
    return value
