"""Structured output: generation held to a grammar (a JSON schema, any JSON object, a regex, a choice, a Lark
grammar) by llguidance, one token mask per step.

- `tokenizer_bridge`: our tokenizer as llguidance's (`ll_tokenizer`), for every vocabulary we load, cached.
- `grammar`: a request's `StructuredOutputsParams` compiled and checked when the request is made (`compile_grammar`:
  ValueError naming the field), with bounded size, depth and effort.
- `depth`: how deep a JSON schema or a Lark grammar nests (subschemas, $ref chains, rules naming rules), measured
  before llguidance's compiler, which recurses once a level, sees it.
- `compile_pool`: the large-stack threads every compile runs on, whichever thread asks.
- `gate`: where a grammar starts when it waits for a reasoning model's end tag (`GrammarGate`).
- `matcher`: each sequence's `GrammarMatcher`, advanced by the output processor on every token the sequence emits
  (the sequence ends, "stop", when the grammar is complete), and `fill_masks`, with which the scheduler fills the
  masks of a step's constrained rows at once, in parallel and without the GIL.

How constrained rows meet the engine's async scheduling: `jaxserve.batching.engine_core`.
"""
from jaxserve.structured_output.gate import GrammarGate
from jaxserve.structured_output.grammar import Grammar, compile_grammar
from jaxserve.structured_output.matcher import GrammarMatcher, fill_masks
from jaxserve.structured_output.tokenizer_bridge import ll_tokenizer

__all__ = ["Grammar", "GrammarGate", "GrammarMatcher", "compile_grammar", "fill_masks", "ll_tokenizer"]
