"""The package's imports, read with `ast` (nothing is imported): no cycle between modules, and the layers of
docs/architecture.md, where data flows down and never back up.

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
    assert {"jaxserve", "jaxserve.engine.llm", "jaxserve.engine_config", "jaxserve.cli.serve",
            "jaxserve.server"} <= set(MODULES)
    assert any(i.target == "jaxserve.server" for i in IMPORTS["jaxserve.cli.serve"])  # inside cmd_serve
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


# The layers, top to bottom: a module imports only from its own layer and the layers below it. Every wing (package
# or top-level module) of jaxserve is in exactly one layer (test_every_wing_has_a_layer), so a new wing must be placed.
WING_LAYERS = [
    ("the command line, and the launchers of its servers (Ray)", ("jaxserve.cli", "jaxserve.scaleout")),
    ("HTTP: the OpenAI server, the router over servers", ("jaxserve.server", "jaxserve.router")),
    ("the wire format, jax-free", ("jaxserve.openai",)),
    ("the engine APIs, and deviceless analysis of their programs", ("jaxserve.engine", "jaxserve.aot")),
    ("the host loop, and the config it is built from", ("jaxserve.batching", "jaxserve.engine_config")),
    ("concerns the host loop uses", ("jaxserve.quantize", "jaxserve.cascade", "jaxserve.structured_output",
                                     "jaxserve.kv_transfer")),
    ("the device side as the host sees it", ("jaxserve.runner",)),
    ("sampling, adapters, the multi-process step message", ("jaxserve.sample", "jaxserve.lora", "jaxserve.multihost")),
    ("the model over a params pytree, its loaders and its mesh", ("jaxserve.model", "jaxserve.weights",
                                                                   "jaxserve.parallel")),
    ("kernels, and the KV cache's layout and page bookkeeping", ("jaxserve.pallas_kernels", "jaxserve.cpu_kernels",
                                                                  "jaxserve.cache")),
    ("public types and leaves", ("jaxserve.config", "jaxserve.batch", "jaxserve.buckets", "jaxserve.options",
                                 "jaxserve.sampling_params", "jaxserve.outputs", "jaxserve.spec_config",
                                 "jaxserve.cli_flags", "jaxserve.paths", "jaxserve.tokenizer", "jaxserve.hex_mac")),
]


def layer_of(module: str) -> int | None:
    return next((n for n, (_, wings) in enumerate(WING_LAYERS) if under(module, *wings)), None)


def test_every_wing_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != "jaxserve" and layer_of(m) is None)
    assert not unplaced, f"modules in no layer of WING_LAYERS (place their wing): {unplaced}"


@pytest.mark.parametrize("layer", range(len(WING_LAYERS)), ids=[name for name, _ in WING_LAYERS])
def test_no_import_runs_up_a_layer(layer):
    bad = [i for m in MODULES if layer_of(m) == layer for i in IMPORTS[m]
           if i.target != "jaxserve" and layer_of(i.target) is not None and layer_of(i.target) < layer]
    assert not bad, (f"{WING_LAYERS[layer][0]} imports from a layer above it:\n  " + "\n  ".join(
        f"{i}  (layer: {WING_LAYERS[layer_of(i.target)][0]})" for i in bad))


def test_no_private_name_crosses_modules():
    """A `_name` is its module's own: one another module needs is public, in the module where it belongs."""
    bad = [i for edges in IMPORTS.values() for i in edges if any(n.startswith("_") for n in i.names)]
    assert not bad, "private names imported across modules:\n  " + "\n  ".join(map(str, bad))


# Rules inside a layer, or stricter than it: (who, what it must not import, why)
LAYERS = [
    (("jaxserve.pallas_kernels", "jaxserve.cpu_kernels"),
     ("jaxserve.model", "jaxserve.weights", "jaxserve.parallel"),
     "kernels take arrays: they import no model code"),
    (("jaxserve.options",), ("jaxserve",), "the option values are a leaf: they import nothing of jaxserve"),
    (("jaxserve.server",), ("jaxserve.batching", "jaxserve.cache", "jaxserve.runner", "jaxserve.model"),
     "the server sees the engine through its client protocol (jaxserve.engine.client)"),
    (("jaxserve.cache",), ("jaxserve.pallas_kernels", "jaxserve.cpu_kernels"),
     "the KV cache's layout is data: kernels read it, it knows no kernel"),
    (("jaxserve.structured_output", "jaxserve.cascade", "jaxserve.kv_transfer"),
     ("jaxserve.quantize", "jaxserve.cascade", "jaxserve.structured_output", "jaxserve.kv_transfer"),
     "one concern each: they do not import each other"),
]


@pytest.mark.parametrize("importers, forbidden, why", LAYERS, ids=[layer[0][0] for layer in LAYERS])
def test_layers(importers, forbidden, why):
    bad = [i for m in MODULES if under(m, *importers) for i in IMPORTS[m]
           if under(i.target, *forbidden) and not any(under(m, w) and under(i.target, w) for w in forbidden)]
    assert not bad, f"{why}, but:\n  " + "\n  ".join(map(str, bad))


ROUTER_MAY_IMPORT = ("jaxserve.router", "jaxserve.openai")


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


def test_the_house_keeps_its_shape():
    """What a newcomer navigates: few modules at the top (public types and leaves; the rest live in their wing), no
    file too long to read whole, no function too long to hold in mind."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 13, f"{len(top)} modules at the top of jaxserve/ (at most 13; give the new one a wing): {top}"
    long_files = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > 400]
    assert not long_files, "files over 400 lines (split them along their seams):\n  " + "\n  ".join(long_files)
    long_functions = [f"{p.relative_to(PACKAGE.parent)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
                      for p in MODULES.values() for f in ast.walk(ast.parse(p.read_text()))
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno >= 80]
    assert not long_functions, "functions over 80 lines:\n  " + "\n  ".join(long_functions)
