"""The package's imports, read with `ast` (nothing is imported): no cycle between modules, and the layers of
DESIGN.md, where data flows down and never back up.

Every import statement counts, wherever it stands: a lazy import inside a function still makes its module depend on
the other at run time, so one written to break a cycle is still a cycle. An import counts as an edge to the most
specific jaxserve module it names (`from jaxserve.cache import kv_cache` -> jaxserve.cache.kv_cache; `from
jaxserve.cache import KV_CACHE_DTYPES` -> jaxserve.cache). Not counted: the parent packages an import runs on the
way (`import jaxserve.batching.scheduler` runs jaxserve/__init__.py and jaxserve/batching/__init__.py): the top
package re-exports the public API from the top layer, so counting it would put every module in a cycle with it.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxserve"


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the jaxserve module imported
    names: tuple[str, ...]  # what `from target import ...` takes (empty for `import target`)
    line: int
    path: Path

    def __str__(self) -> str:
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else f"import {self.target}"
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line} ({self.module}): {what}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, (), node.lineno, path) for a in node.names
                      if a.name.split(".")[0] == "jaxserve"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            if source.split(".")[0] != "jaxserve":
                continue
            by_target: dict[str, list[str]] = {}
            for a in node.names:  # a submodule imported by name is an edge to it
                target = f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                by_target.setdefault(target, []).append(a.name)
            found += [Import(module, t, tuple(names), node.lineno, path) for t, names in by_target.items()]
    return found


IMPORTS = {m: imports_of(m) for m in MODULES}


def under(module: str, *prefixes: str) -> bool:
    """module is one of `prefixes` or inside one of them (a package)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_reader_sees_the_package():
    """Guards the guards: the modules are found, and so are imports inside functions (cli's lazy ones)."""
    assert {"jaxserve", "jaxserve.engine.llm", "jaxserve.engine_config", "jaxserve.cli", "jaxserve.server"} <= set(MODULES)
    assert any(i.target == "jaxserve.server" for i in IMPORTS["jaxserve.cli"])  # inside cmd_serve
    assert all(i.target in MODULES for edges in IMPORTS.values() for i in edges), "an import of no jaxserve module"


def test_no_import_cycle():
    # Tarjan's strongly connected components: a component of several modules (or a module importing itself) is a
    # cycle; the message lists the imports that close it.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for i in IMPORTS[v]:
            w = i.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or any(i.target == v for i in IMPORTS[v]):
                cycles.append(component)

    for m in MODULES:
        if m not in index:
            visit(m)
    report = [f"cycle among {sorted(c)}:\n  " + "\n  ".join(str(i) for m in sorted(c) for i in IMPORTS[m]
                                                            if i.target in c) for c in cycles]
    assert not cycles, "\n".join(report)


# (who, what it must not import, why)
LAYERS = [
    (("jaxserve.pallas_kernels",),
     ("jaxserve.model", "jaxserve.model.attention", "jaxserve.runner.steps", "jaxserve.engine.llm", "jaxserve.engine.async_engine",
      "jaxserve.batching", "jaxserve.server", "jaxserve.openai.api", "jaxserve.cli"),
     "kernels take arrays: they import no model code"),
    (("jaxserve.engine_config", "jaxserve.options", "jaxserve.cli_flags"),
     ("jaxserve.engine.llm", "jaxserve.engine.async_engine", "jaxserve.batching", "jaxserve.server", "jaxserve.openai.api",
      "jaxserve.cli"),
     "the config is below the engine it configures"),
    (("jaxserve.options",), ("jaxserve",), "the option values are a leaf: they import nothing of jaxserve"),
    (("jaxserve.batching",),
     ("jaxserve.engine.llm", "jaxserve.engine.async_engine", "jaxserve.server", "jaxserve.openai.api", "jaxserve.cli"),
     "the host loop is below the engine APIs and the server"),
    (("jaxserve.cascade",),
     ("jaxserve.engine.llm", "jaxserve.engine.async_engine", "jaxserve.batching", "jaxserve.server", "jaxserve.openai.api",
      "jaxserve.cli"),
     "cascade routing's features, router file and policy read outputs: the server applies them, scripts train them"),
]


@pytest.mark.parametrize("importers, forbidden, why", LAYERS, ids=[layer[0][0] for layer in LAYERS])
def test_layers(importers, forbidden, why):
    bad = [i for m in MODULES if under(m, *importers) for i in IMPORTS[m] if under(i.target, *forbidden)]
    assert not bad, f"{why}, but:\n  " + "\n  ".join(map(str, bad))


def test_nothing_below_the_server_imports_it():
    """The server (jaxserve.server, its wire format openai_api with its structured-output and tool-call fields, and
    its metrics) is imported only by itself, the router over servers (jaxserve.router) and the command line."""
    top = ("jaxserve.server", "jaxserve.openai.api", "jaxserve.openai.structured", "jaxserve.openai.tool_calls",
           "jaxserve.openai.metrics", "jaxserve.openai.http", "jaxserve.router", "jaxserve.cli")
    bad = [i for m in MODULES if not under(m, *top) for i in IMPORTS[m] if under(i.target, *top)]
    assert not bad, "the server is the top layer, but:\n  " + "\n  ".join(map(str, bad))


ROUTER_MAY_IMPORT = ("jaxserve.router", "jaxserve.openai.http", "jaxserve.openai.api", "jaxserve.openai.tool_calls",
                     "jaxserve.openai.metrics")


def test_the_router_imports_no_engine():
    """The router over servers forwards HTTP: it imports the wire format and the shared HTTP helpers, never a server
    or an engine (nor, so, jax: it starts in a fraction of a second on a host with no accelerator)."""
    bad = [i for m in MODULES if under(m, "jaxserve.router") for i in IMPORTS[m]
           if not under(i.target, *ROUTER_MAY_IMPORT)]
    assert not bad, "the router imports more than the wire format:\n  " + "\n  ".join(map(str, bad))
    loaded = subprocess.run([sys.executable, "-c", "import sys, jaxserve.router; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"],
                            capture_output=True, text=True, check=True, cwd=PACKAGE.parent,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}).stdout.strip()
    assert loaded == "[]", f"importing jaxserve.router imports {loaded}"


def test_a_sequence_does_not_import_the_batch_builder():
    """The sequence is the host loop's bottom: the batch builder reads sequences, not the other way round."""
    bad = [i for i in IMPORTS["jaxserve.batching.sequence"] if i.target == "jaxserve.runner.batch_builder"]
    assert not bad, "\n  ".join(["jaxserve.batching.sequence imports the batch builder:", *map(str, bad)])


def test_the_async_engine_takes_request_metrics_from_below_the_engine():
    bad = [i for i in IMPORTS["jaxserve.engine.async_engine"]
           if i.target == "jaxserve.engine.llm" and "request_metrics" in i.names]
    assert not bad, "\n  ".join(["request_metrics is the engine's helper; it belongs below it:", *map(str, bad)])
