"""Command-line flags declared on a config dataclass's fields (`field(metadata={"cli": Flag(...)})`), so that an
option is one field, written once: `add_flags` makes the argparse flags from the fields, `read_flags` the fields'
values back from the parsed arguments. Used by `EngineConfig` (jaxserve.engine_config).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Callable, Iterable

_AS_SERVE = object()  # offline_default not given: generate and chat default as serve does
_TYPES = {"int": int, "float": float, "str": None}  # a field's annotation (less "| None") -> argparse's type


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a field is set on the `jaxserve` command line (generate, chat and serve; the quantization flags also
    convert's): --NAME (the field's name with dashes) of the field's type (int, float or str, from its annotation);
    a bool field is a switch that turns its default over (--no-NAME for a default of True, --NAME for False), or
    both (--NAME and --no-NAME) for a default of None (decided later).

    help, metavar, choices: argparse's. serve_help: appended to help under serve. repeat_in_serve: serve takes it
    several times (a list: --model). How generate and chat (one prompt at a time) differ: serve_only (no flag there),
    offline_default (their default, flag or not), offline_help (their help). name, read_value: another flag name
    (--calibration-file), and what turns its value into the field's. aliases: more flags for it (vLLM's "-dcp").
    """

    help: str | None
    metavar: str | None = None
    choices: tuple | None = None
    serve_help: str = ""
    repeat_in_serve: bool = False
    serve_only: bool = False
    offline_default: object = _AS_SERVE
    offline_help: str | None = None
    name: str | None = None
    read_value: Callable | None = None
    aliases: tuple[str, ...] = ()

    def add(self, p: argparse.ArgumentParser, field: dataclasses.Field, serving: bool) -> None:
        default, help = field.default, self.help
        if serving:
            help = help + self.serve_help if self.serve_help else help
        else:
            if self.offline_default is not _AS_SERVE:
                default = self.offline_default
            if self.serve_only:
                if self.offline_default is not _AS_SERVE:
                    p.set_defaults(**{field.name: default})
                return
            help = self.offline_help or help
        kw = dict(default=default, help=help)
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        if self.choices is not None:
            kw["choices"] = list(self.choices)
        kind = field.type.removesuffix(" | None")
        if kind == "bool" and default is None:  # decided later unless given: --NAME and --no-NAME
            p.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                           action=argparse.BooleanOptionalAction, **kw)
            return
        if kind == "bool":  # a switch away from the default
            name = ("no-" if default else "") + field.name.replace("_", "-")
            p.add_argument("--" + name, dest=field.name, action="store_false" if default else "store_true", **kw)
            return
        if _TYPES[kind] is not None:
            kw["type"] = _TYPES[kind]
        if serving and self.repeat_in_serve:
            kw["action"] = "append"
        p.add_argument("--" + (self.name or field.name.replace("_", "-")), *self.aliases, **kw)

    def read(self, field: dataclasses.Field, args: argparse.Namespace) -> dict:
        """{field: value} from parsed flags; nothing if the command has no such flag (the field keeps its default)."""
        dest = (self.name or field.name).replace("-", "_")
        if not hasattr(args, dest):
            return {}
        value = getattr(args, dest)
        return {field.name: self.read_value(value) if self.read_value is not None else value}


def flag(help: str | None, *, default=None, **how) -> dataclasses.Field:
    """A dataclass field with its command-line flag (see Flag)."""
    return dataclasses.field(default=default, metadata={"cli": Flag(help, **how)})


@dataclasses.dataclass(frozen=True)
class FlagGroup:
    """A field set by several flags (speculative_config): add(parser) declares them, read(args) -> the value."""

    add_flags: Callable[[argparse.ArgumentParser], None]
    read_flags: Callable[[argparse.Namespace], object]

    def add(self, p: argparse.ArgumentParser, field: dataclasses.Field, serving: bool) -> None:
        self.add_flags(p)

    def read(self, field: dataclasses.Field, args: argparse.Namespace) -> dict:
        return {field.name: self.read_flags(args)}


def add_flags(cls, p: argparse.ArgumentParser, serving: bool, names: Iterable[str] | None = None) -> None:
    """The flags of `cls`'s fields (those of `names` only, if given), in field order."""
    for field in dataclasses.fields(cls):
        if "cli" in field.metadata and (names is None or field.name in names):
            field.metadata["cli"].add(p, field, serving)


def read_flags(cls, args: argparse.Namespace, names: Iterable[str] | None = None) -> dict:
    """{field: value} of the flags `add_flags` declared and `args` holds (a field without its flag is left out)."""
    given = {}
    for field in dataclasses.fields(cls):
        if "cli" in field.metadata and (names is None or field.name in names):
            given.update(field.metadata["cli"].read(field, args))
    return given


def json_object_flag(flag: str, text: str, example: str) -> dict:
    """A flag's value that is a JSON object (vLLM's --hf-overrides, --speculative-config; --ray-bundle): parsed, or
    a ValueError naming the flag and showing an example."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object such as '{example}': {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object such as '{example}', got {text!r}")
    return value
