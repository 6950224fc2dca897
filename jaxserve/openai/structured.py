"""Structured output asked for in a request body -> one `StructuredOutputsParams` and the field that asked for it.

Three spellings: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's request extension
`structured_outputs` ({json | regex | choice | grammar | json_object}), and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request uses at most one (tool calls that a grammar enforces
count as one too: `jaxserve.openai.tool_calls`). The field is kept so that a grammar the engine cannot compile is a 400
naming what the client sent.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.tokenizer import check_unicode

# Request fields (both endpoints) and the JSON types each accepts.
FIELDS = {"response_format": (dict,), "structured_outputs": (dict,), "guided_json": (dict, str),
          "guided_regex": (str,), "guided_choice": (list,), "guided_grammar": (str,),
          "guided_decoding_backend": (str,)}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# guided_decoding_backend values that name this server's one backend.
BACKENDS = ("guidance", "llguidance", "auto")
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class Structured:
    params: StructuredOutputsParams
    field: str  # the request field it came from: a 400 for a grammar that does not compile names it


class FieldError(ValueError):
    """A bad request field: `field` is the request's field it is about (the 400's `param`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def parse_structured(body: dict) -> Structured | None:
    """The structured output a request body asks for (None: free text). Raises FieldError."""
    asked = [_response_format(body.get("response_format")), _structured_outputs(body.get("structured_outputs")),
             *_guided(body)]
    found = [s for s in asked if s is not None]
    if len(found) > 1:
        raise FieldError(f"{found[0].field} and {found[1].field} both ask for structured output: send one",
                         found[1].field)
    return found[0] if found else None


def _make(field: str, **kind) -> Structured:
    try:
        params = StructuredOutputsParams(**kind)
    except ValueError as e:
        raise FieldError(f"{field}: {e}", field) from None
    check_text(kind, field)
    return Structured(params, field)


def check_text(value, field: str) -> None:
    """FieldError if a JSON value holds a lone surrogate (JSON's "\\ud800" escape): no grammar or prompt can
    spell it, or if it nests too deeply to write (the body parser's recursion limit is Python's too, but it ran
    with fewer frames above it)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise FieldError(f"{field} is nested too deeply", field) from None
    try:
        check_unicode(text, field)
    except ValueError as e:
        raise FieldError(str(e), field) from None


def _response_format(rf: dict | None) -> Structured | None:
    if rf is None:
        return None
    kind = rf.get("type")
    expected = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in expected:
        raise FieldError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         "response_format")
    if set(rf) - expected[kind]:
        raise FieldError(f"unknown response_format fields {sorted(set(rf) - expected[kind])}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("response_format.json_schema must be an object {name, schema, strict, description}",
                         "response_format")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise FieldError(f"unknown response_format.json_schema fields {sorted(unknown)}", "response_format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise FieldError("response_format.json_schema.name must be a non-empty string", "response_format")
    for key, types, what in (("strict", bool, "a boolean"), ("description", str, "a string"),
                             ("schema", dict, "an object (a JSON schema)")):
        if spec.get(key) is not None and not isinstance(spec[key], types):
            raise FieldError(f"response_format.json_schema.{key} must be {what}", "response_format")
    # Strict or not, the schema is enforced by the grammar (stricter than `strict: false` asks); no schema: any JSON.
    schema = spec.get("schema")
    return _make("response_format", json={} if schema is None else schema)


def _structured_outputs(so: dict | None) -> Structured | None:
    if so is None:
        return None
    unknown = set(so) - set(_SO_KEYS)
    if unknown:
        raise FieldError(f"unsupported structured_outputs fields {sorted(unknown)} (this server takes "
                         f"{', '.join(_SO_KEYS)})", "structured_outputs")
    kind = {k: v for k, v in so.items() if v is not None}
    if kind.get("json_object") is False:
        del kind["json_object"]
    if "json_object" in kind and kind["json_object"] is not True:
        raise FieldError("structured_outputs.json_object must be a boolean", "structured_outputs")
    return _make("structured_outputs", **kind)


def _guided(body: dict) -> list[Structured]:
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise FieldError(f"guided_decoding_backend {backend!r} is not served here: structured output uses "
                         f"llguidance ({', '.join(BACKENDS)})", "guided_decoding_backend")
    return [_make(field, **{kind: body[field]}) for field, kind in _GUIDED.items() if body.get(field) is not None]
