"""A request's StructuredOutputsParams compiled into an llguidance grammar against the model's tokenizer, checked
when the request is made: whatever is wrong with it (a schema that is no JSON, an unsupported JSON-schema keyword,
a regex or Lark grammar that does not parse, one too large) is a ValueError naming the field, before any sequence
exists.

Compiling is bounded: the spec's text by MAX_SPEC_CHARS, its depth by MAX_DEPTH (llguidance's compiler recurses
once a level on its thread's stack, and an overflow is a segfault: `depth`, `compile_pool`), the grammar's size and
the lexer's work by llguidance's limits (LIMITS). It runs on `compile_pool`'s large-stack threads, whatever thread
asks. It may still take a while for a large schema (up to about a second), and releases the GIL while it works:
callers on an event loop call it from a thread (`AsyncEngine.add_request` does). A compiled grammar is kept (the last
CACHE_SIZE of them), so the same schema sent again costs a copy.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading

import llguidance

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output import compile_pool
from jaxserve.structured_output.depth import lark_depth, schema_depth
from jaxserve.structured_output.matcher import GrammarMatcher
from jaxserve.structured_output.tokenizer_bridge import ll_tokenizer
from jaxserve.tokenizer import Tokenizer

# JSON as Python's json.dumps writes it: one space after ',' and ':', no other whitespace. A grammar that allows
# any whitespace lets a weak model pad forever with newlines (a known failure of flexible whitespace); a schema
# may still ask for it with llguidance's "x-guidance": {"whitespace_flexible": true}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 100_000  # a schema's JSON text, a regex, a Lark grammar, or the choices together
# The longest chain of subschemas nested in each other and $refs followed, or of Lark rules each naming the next
# (`depth`). On a default 8 MiB stack llguidance overflows at about 2,500 (a $ref chain, a rule chain; a chain of
# objects' properties at about 880 levels of 3); real schemas nest tens deep. llguidance bounds the rest itself:
# JSON nested past 128 levels, regexes past ~250 groups, Lark parentheses past ~30 are errors.
MAX_DEPTH = 1_000
# llguidance's bounds on one grammar (its defaults in brackets): symbols in its productions [500k; 50k compile in
# about a second], the lexer's work building its regexes at compile time [1M, ~50k per ms] and its states [250k,
# 1-2 kB each]. The per-token
# bounds stay llguidance's (a mask step's lexer work [200k, ~14k per ms] and parser items [50k]): a grammar that
# hits one while generating fails, and allows only EOS from then on.
LIMITS = dict(max_grammar_size=50_000, initial_lexer_fuel=1_000_000, max_lexer_states=50_000)
CACHE_SIZE = 64
MAX_ERROR_CHARS = 500


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A compiled grammar; each sequence that follows it gets its own matcher."""
    kind: str  # json | json_object | regex | choice | grammar
    _compiled: llguidance.LLMatcher  # never advanced: the matchers are copies of it
    vocab_size: int

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._compiled.deep_copy(), self.vocab_size)


_cache: collections.OrderedDict = collections.OrderedDict()  # (LLTokenizer, builder, spec) -> compiled LLMatcher
_cache_lock = threading.Lock()


def compile_grammar(params: StructuredOutputsParams, tokenizer: Tokenizer | None, vocab_size: int) -> Grammar:
    """The grammar `params` asks for, over a model of `vocab_size` logits. ValueError naming the field if it is
    malformed, unsupported or too large."""
    field = f"structured_outputs.{params.kind}"
    if tokenizer is None:
        raise ValueError(f"{field}: structured output needs the model's tokenizer, and this model has none")
    if not tokenizer.eos_token_ids:  # a grammar that may end or go on ends with EOS
        raise ValueError(f"{field}: structured output needs an end-of-sequence token, and this model's tokenizer "
                         "has none")
    builder, spec = _spec(params, field)
    ll = ll_tokenizer(tokenizer, vocab_size)
    key = (ll, builder, spec)
    with _cache_lock:
        compiled = _cache.get(key)
        if compiled is not None:
            _cache.move_to_end(key)
    if compiled is None:
        # Outside the lock: two threads may compile the same grammar at once, but no compile waits on another.
        compiled = compile_pool.run(_compile, ll, builder, spec)
        if compiled.is_error():
            raise ValueError(f"{field}: {_short(compiled.get_error())}")
        with _cache_lock:
            _cache[key] = compiled
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    return Grammar(params.kind, compiled, vocab_size)


_BUILDERS = {"json": lambda spec: llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS),
             "regex": llguidance.LLMatcher.grammar_from_regex, "lark": llguidance.LLMatcher.grammar_from_lark}


def _compile(ll: llguidance.LLTokenizer, builder: str, spec: str) -> llguidance.LLMatcher:
    """On a compile thread (all of llguidance's work on a spec: it may recurse deep)."""
    return llguidance.LLMatcher(ll, _BUILDERS[builder](spec), log_level=0, limits=llguidance.LLParserLimits(**LIMITS))


def _spec(params: StructuredOutputsParams, field: str) -> tuple[str, str]:
    """The builder (json, regex or lark) and text llguidance compiles, checked for size and depth (what else is
    wrong with it, compiling finds)."""
    if params.json is not None:
        schema, text = _schema(params.json, field)
        _check_depth(schema_depth(schema), field, "the schema nests (subschemas within subschemas, and $ref chains)")
        return "json", text
    if params.json_object:
        return "json", json.dumps({"type": "object"})
    if params.regex is not None:
        _check_size(params.regex, field)
        return "regex", params.regex
    if params.choice is not None:
        _check_size("".join(params.choice), field)
        # Lark's string literals are JSON's, so any choice is spelled exactly.
        return "lark", "start: " + " | ".join(map(json.dumps, params.choice))
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one kind
    _check_size(params.grammar, field)
    _check_depth(lark_depth(params.grammar), field, "its rules nest (rules naming rules, %json schemas)")
    return "lark", params.grammar


def _schema(schema: dict | str, field: str) -> tuple[dict | bool, str]:
    """A JSON schema (an object, or its JSON text) and its JSON text."""
    if isinstance(schema, str):
        _check_size(schema, field)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError(f"{field}: JSON nested too deeply to read") from None
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema is an object (or true / false), got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except RecursionError:  # offline: a dict nested past Python's recursion limit
        raise ValueError(f"{field}: JSON nested too deeply to read") from None
    except (TypeError, ValueError) as e:  # offline: a dict holding what JSON cannot spell
        raise ValueError(f"{field}: not a JSON document: {e}") from None
    _check_size(text, field)
    return schema, text


def _check_depth(depth: int, field: str, what: str) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{field}: {what} {depth} levels deep; at most {MAX_DEPTH} are compiled")


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{field}: {len(text)} characters; at most {MAX_SPEC_CHARS} are compiled")


def _short(error: str) -> str:
    error = error.strip()
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + " ..."
