"""How deep a JSON schema or a Lark grammar nests, measured in Python before llguidance compiles it.

llguidance's compiler descends once a level (into a subschema, through a `$ref`, into a rule another rule names), on
the thread's stack (see `compile_pool`), so a spec's depth is what bounds the stack it needs: `grammar.MAX_DEPTH`
refuses the deep ones with an error instead. Both measures walk with explicit stacks (a document nested deeper than
Python's recursion limit is measured too) in time linear in the spec, and count edges: a chain of n `$ref` hops or
n rules naming the next measures about n.

A reference back into the chain being followed (a recursive schema, a recursive rule) ends it, as it ends the
compiler's descent, which compiles each definition once.
"""
from __future__ import annotations

import json
import re
from urllib.parse import unquote, urldefrag, urljoin

# The base URI of a schema without `$id`: absolute, so that relative `$id`s and `$ref`s resolve against it as URIs do.
_ROOT_URI = "http://schema.invalid/root.json"
_ON_PATH = -2
_UNSEEN = -1


def schema_depth(schema) -> int:
    """The longest chain of subschemas nested in each other and `$ref`s followed to what they name (a JSON pointer,
    an `$anchor` or an `$id`, resolved as JSON Schema resolves them; a reference that names nothing here is left to
    the compiler's error). Every object and array of the document counts as a level."""
    doc = _Document(schema)
    for node, target in doc.refs:
        found = doc.resolve(target)
        if found is not None:
            doc.edges[node].append(found)
    return longest_path(doc.edges)


class _Document:
    """A JSON schema's objects and arrays as a graph (node 0 the root): each one's children, by key and as edges,
    the `$ref`s to resolve (node, absolute URI), and the nodes that URIs name without a JSON pointer: resources
    (`$id`) and anchors."""

    def __init__(self, schema):
        self.edges: list[list[int]] = []
        self.keys: list[dict[str, int]] = []
        self.refs: list[tuple[int, str]] = []
        self.resources: dict[str, int] = {_ROOT_URI: 0}
        self.anchors: dict[tuple[str, str], int] = {}
        todo = [(schema, -1, "", _ROOT_URI)]  # (value, parent node, its key there, the base URI its parent is in)
        while todo:
            value, parent, key, base = todo.pop()
            node = len(self.edges)
            self.edges.append([])
            self.keys.append({})
            if parent >= 0:
                self.edges[parent].append(node)
                self.keys[parent][key] = node
            if isinstance(value, dict):
                base = self._name(node, value, base)
                items = [(str(k), v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):  # (a tuple: offline, where JSON has an array)
                items = [(str(i), v) for i, v in enumerate(value)]
            else:
                items = []
            for k, child in reversed(items):  # reversed: popped in the document's order
                if isinstance(child, (dict, list, tuple)):
                    todo.append((child, node, k, base))

    def _name(self, node: int, value: dict, base: str) -> str:
        """Records what names an object, and its `$ref`; returns the base URI within it."""
        if isinstance(value.get("$id"), str):
            base, fragment = urldefrag(urljoin(base, value["$id"]))
            if fragment:  # draft 4-7: an `$id` of "#name" is an anchor
                self.anchors[(base, fragment)] = node
            else:
                self.resources[base] = node
        if isinstance(value.get("$anchor"), str):
            self.anchors[(base, value["$anchor"])] = node
        if isinstance(value.get("$ref"), str):
            self.refs.append((node, urljoin(base, value["$ref"])))
        return base

    def resolve(self, target: str) -> int | None:
        uri, fragment = urldefrag(target)
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            return self.anchors.get((uri, fragment))
        node = self.resources.get(uri)
        for step in fragment.split("/")[1:]:  # a JSON pointer: /key/key..., with ~1 for / and ~0 for ~
            if node is None:
                break
            node = self.keys[node].get(step.replace("~1", "/").replace("~0", "~"))
        return node


def longest_path(edges: list[list[int]], weights: list[int] | None = None) -> int:
    """The most edges on a path from node 0 that visits no node twice, a node of weight w counting as a chain of w
    more (depth-first, each node's longest path kept: an edge back into the path being walked is not followed)."""
    depth = [_UNSEEN] * len(edges)
    depth[0] = _ON_PATH
    path = [(0, 0)]  # (node, its next edge to follow)
    while path:
        node, i = path[-1]
        if i < len(edges[node]):
            path[-1] = (node, i + 1)
            child = edges[node][i]
            if depth[child] == _UNSEEN:
                depth[child] = _ON_PATH
                path.append((child, 0))
            continue
        path.pop()
        depth[node] = max([depth[c] + 1 for c in edges[node] if depth[c] >= 0]
                          + [weights[node] if weights is not None else 0])
    return depth[0]


# A Lark grammar's tokens, as far as depth goes: names, line ends, directives (%json, %ignore, ...), and what is
# skipped whole (comments, strings, regexes, special tokens, runs of anything else).
_LARK_TOKEN = re.compile(r"""
    (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<newline>\n)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<skip>//[^\n]*|"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[a-z]*|<[^<>\n]*>|[^A-Za-z_\n%"/<]+|.)
""", re.VERBOSE | re.DOTALL)
_JSON_DIRECTIVES = ("%json", "%regex", "%llguidance")  # each followed by a JSON object
_decoder = json.JSONDecoder()


def lark_depth(text: str) -> int:
    """The longest chain of rules (and terminals) each naming the next, in llguidance's Lark dialect, a rule that
    embeds a JSON schema (%json {...}) counting that schema's depth below it. Text this reading cannot follow is
    left to the compiler's error."""
    rules: dict[str, int] = {}  # name -> node; node 0 is the grammar, which names every rule
    names: list[list[str]] = [[]]  # the names each node's body mentions
    weights = [0]  # each node's deepest embedded schema
    current, line_start, pos = 0, True, 0
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        assert m is not None  # `skip` takes any character
        kind, token, pos = m.lastgroup, m.group(), m.end()
        if kind == "skip":  # (a line's leading ? or ! too)
            continue
        head = _HEAD.match(text, pos) if line_start and kind == "name" else None
        if head is not None:  # a definition: its body follows, to the next one
            current = rules.setdefault(token, len(names))
            if current == len(names):
                names.append([])
                weights.append(0)
            names[0].append(token)
            pos = head.end()
        elif kind == "name":
            names[current].append(token)
        elif kind == "directive" and line_start:
            current = 0  # %ignore, %import, ...: top level
        if kind == "directive" and token in _JSON_DIRECTIVES:
            try:
                value, pos = _decoder.raw_decode(text, len(text) - len(text[pos:].lstrip()))
            except (ValueError, RecursionError):
                break  # no JSON, or nested past what llguidance's parser takes: it says so
            if token == "%json":
                weights[current] = max(weights[current], schema_depth(value) + 1)
        line_start = kind == "newline"
    return longest_path([[rules[n] for n in refs if n in rules] for refs in names], weights)


# A definition's head after its name: attributes ([lazy, stop="x"]), a priority (.2), then its colon.
_HEAD = re.compile(r"""[ \t]*(?:\[(?:[^\]"\n]|"(?:[^"\\\n]|\\.)*")*\][ \t]*)?(?:\.[ \t]*-?[0-9]+[ \t]*)?:""")
