"""Chat templates: the jinja environment they render in (as HF's apply_chat_template sets it up), and the
`--chat-template` file, checked when it is read."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as HF renders them).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def read_chat_template(path) -> str:
    """A jinja chat template file's text (`--chat-template`); ValueError naming the file if it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        jinja_env().from_string(text)  # a syntax error shows now, not at the first chat request
    except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as e:
        raise ValueError(f"cannot use chat template file {path}: {e}") from None
    return text
