"""Tool calls in chat, the request's side: `tools` / `tool_choice` / `parallel_tool_calls` checked into a
`ToolRequest`, the grammar that enforces `required` and a named function, and the parser (`tool_parsers`) that turns
a choice's generated text into OpenAI tool-call deltas.

- `required`: the output is a JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]` (at least one; one
  unless parallel_tool_calls), each an anyOf over the tools with that function's `parameters` schema (vLLM's way).
- a named function: the output is that function's arguments (its `parameters` schema).
- `auto`: the model writes calls in its own format, read by the served model's parser (`--tool-call-parser`, or
  the one its chat template's format implies: jaxserve.openai.tool_call_parsers); a server serves auto only with
  `--enable-auto-tool-choice`, as vLLM.
- `none`: the tools still reach the template (as vLLM sends them), the output is never parsed.
"""
from __future__ import annotations

import dataclasses
import re

from jaxserve.openai.structured import FieldError, check_text
from jaxserve.openai.tool_parsers import ArrayCalls, NamedCall
from jaxserve.sampling_params import StructuredOutputsParams

FIELDS = {"tools": (list,), "tool_choice": (str, dict), "parallel_tool_calls": (bool,)}
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    parameters: dict  # a JSON schema for its arguments
    description: str | None = None
    strict: bool | None = None


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # as sent: what the chat template gets (HF's apply_chat_template(tools=...))
    functions: dict[str, Function]
    choice: str  # "none", "auto", "required" or "function" (the one named in `named`)
    named: str | None
    parallel: bool

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that enforces `required` or a named function (None for auto and none)."""
        if self.choice == "function":
            assert self.named is not None  # set whenever choice is "function"
            return StructuredOutputsParams(json=self.functions[self.named].parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]},
                                                   "arguments": f.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in self.functions.values()]
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def parser(self, auto: type | None):
        """A new parser for one choice's output (None: the output is plain content). auto: the parser class of
        tool_choice auto on this model (None: it has none)."""
        if self.choice == "function":
            assert self.named is not None  # set whenever choice is "function"
            return NamedCall(self.named)
        if self.choice == "required":
            return ArrayCalls()
        if self.choice == "auto":
            if auto is None:
                raise FieldError("tool_choice auto needs a tool-call parser for this model's format: start the "
                                 "server with --tool-call-parser (hermes, llama3_json, mistral or qwen3_coder), or "
                                 "use a chat template whose format is recognised; or use tool_choice required or a "
                                 "named function, which a grammar enforces", "tool_choice")
            return auto(self.functions, self.parallel)
        return None


def parse_tools(body: dict) -> ToolRequest | None:
    """The tool request of a chat body (None: no tools). Raises FieldError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise FieldError(f"at most {MAX_TOOLS} tools", "tools")
    check_text(tools, "tools")
    functions = {}
    for i, tool in enumerate(tools):
        f = _function(tool, i)
        if f.name in functions:
            raise FieldError(f"tools[{i}]: a second function named {f.name!r}", "tools")
        functions[f.name] = f
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or set(choice) != {"type", "function"} or not isinstance(fn, dict) \
                or set(fn) != {"name"}:
            raise FieldError('tool_choice must be none, auto, required or {"type": "function", "function": '
                             '{"name": ...}}', "tool_choice")
        if fn["name"] not in functions:
            raise FieldError(f"tool_choice names {fn['name']!r}, which is not one of the tools", "tool_choice")
        choice, named = "function", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise FieldError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
    return ToolRequest(tools, functions, choice, named, True if parallel is None else parallel)


def _function(tool, i: int) -> Function:
    where = f"tools[{i}]"
    if not (isinstance(tool, dict) and tool.get("type") == "function" and set(tool) == {"type", "function"}
            and isinstance(tool["function"], dict)):
        raise FieldError(f'{where} must be {{"type": "function", "function": {{name, description, parameters, '
                         f'strict}}}}', "tools")
    fn = tool["function"]
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise FieldError(f"{where}.function: unknown fields {sorted(unknown)}", "tools")
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise FieldError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", "tools")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object (a JSON schema)"),
                            ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise FieldError(f"{where}.function.{key} must be {what}", "tools")
    parameters = fn.get("parameters")
    return Function(name, _EMPTY_PARAMETERS if parameters is None else parameters, fn.get("description"),
                    fn.get("strict"))
