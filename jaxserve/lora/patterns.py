"""PEFT's per-module overrides of an adapter's rank and alpha (adapter_config.json's rank_pattern and alpha_pattern),
with only the keys whose matching is cheap.

PEFT (`peft.utils.other.get_pattern_key`) takes each key as a regular expression and picks the first that matches a
module's name from a dot on: `re.match(rf"(.*\\.)?({key})$", name)`. A key from a file is
untrusted: `(` does not compile, and `(.|.)*Z` backtracks exponentially (over 20 s on one module's name). The keys
PEFT's own tools write, and its documentation shows, are module names (`o_proj`, `model.layers.0.self_attn.q_proj`,
`^model.layers.0.mlp.up_proj`), so those are the keys taken: word characters and dots (a dot matches any character,
as in PEFT), `\\.`, a leading `^` and a trailing `$`. With no repetition, group or alternation in a key, PEFT's own
match takes at most (name length x key length) steps and gives PEFT's answer; any other key is refused.
"""
from __future__ import annotations

import re

MAX_KEY_CHARS = 256
# A key, token by token: each token begins with a character no other token begins with (a word character, "\.",
# a dot), so checking a key never backtracks either.
_SAFE_KEY = re.compile(r"\^?(?:\w|\\\.|\.)+\$?", re.ASCII)


def compile_patterns(patterns: dict, max_keys: int) -> list[tuple[re.Pattern, object]]:
    """Each key's PEFT match, compiled once (a model's modules are each matched against every key), with its value,
    in the file's order. Raises ValueError naming the first key that is not a module name, or too many keys."""
    if len(patterns) > max_keys:
        raise ValueError(f"{len(patterns)} keys, above the {max_keys} this model's modules can use")
    compiled = []
    for key, value in patterns.items():
        if not (isinstance(key, str) and len(key) <= MAX_KEY_CHARS and _SAFE_KEY.fullmatch(key)):
            shown = key if not isinstance(key, str) or len(key) <= 60 else key[:60] + "..."
            raise ValueError(f"key {shown!r}: only module names are supported (as 'o_proj' or "
                             "'model.layers.0.self_attn.q_proj', optionally starting with '^'), not other regular "
                             f"expressions, of at most {MAX_KEY_CHARS} characters")
        compiled.append((re.compile(rf"(.*\.)?({key})$"), value))
    return compiled


def pattern_value(compiled: list[tuple[re.Pattern, object]], module: str, default):
    """PEFT's value for `module` (its name in the model, e.g. model.layers.0.self_attn.q_proj): the first key that
    matches it from a dot on, else `default`."""
    for pattern, value in compiled:
        if pattern.match(module):
            return value
    return default
