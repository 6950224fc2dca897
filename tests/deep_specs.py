"""Deep grammars for the structured-output depth tests: chains of `$ref`s and of Lark rules, each n deep, in the
shapes that cost llguidance's recursive compiler the most stack per level or fit the most levels in the size cap.
Schemas are dicts (their JSON text is json.dumps'), Lark grammars text."""
import json


def name(i: int) -> str:
    """A short distinct name for each i: a .. z, aa, ab, ..."""
    s, i = "", i + 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def ref_chain(n: int) -> dict:
    """n `$ref`s through `$defs`, each naming the next (issue 48's reproduction)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_chain_short(n: int) -> dict:
    """n `$ref`s by JSON pointers to short top-level keys: the most levels in the size cap."""
    schema = {"$ref": "#/" + name(0).upper()}
    for i in range(n):  # upper case: never a keyword
        schema[name(i).upper()] = {"$ref": "#/" + name(i + 1).upper()}
    schema[name(n).upper()] = {"type": "integer"}
    return schema


def property_chain(n: int) -> dict:
    """n objects, each one's property a `$ref` to the next: the most stack per `$ref`."""
    schema = {"$ref": "#/" + name(0).upper()}
    for i in range(n):
        schema[name(i).upper()] = {"properties": {"a": {"$ref": "#/" + name(i + 1).upper()}}}
    schema[name(n).upper()] = {}
    return schema


def anchor_chain(n: int) -> dict:
    """n `$ref`s by `$anchor`."""
    defs = {f"d{i}": {"$anchor": f"A{i}", "$ref": f"#A{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"$anchor": f"A{n}", "type": "integer"}
    return {"$ref": "#A0", "$defs": defs}


def rule_chain(n: int) -> str:
    """n Lark rules `rN: rN+1 rN+1 | "x"` (issue 48's reproduction)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} r{i + 1} | "x"\n' for i in range(n)) + f'r{n}: "x"\n'


def rule_chain_short(n: int) -> str:
    """n Lark rules each naming the next: the most levels in the size cap."""
    return f"start: {name(0)}\n" + "".join(f"{name(i)}: {name(i + 1)}\n" for i in range(n)) + f'{name(n)}: "x"\n'


def terminal_chain(n: int) -> str:
    """n Lark terminals each naming the next."""
    rules = "".join(f"{name(i).upper()}: {name(i + 1).upper()}\n" for i in range(n))
    return f"start: {name(0).upper()}\n" + rules + f'{name(n).upper()}: "x"\n'


def embedded_ref_chain(n: int) -> str:
    """A Lark grammar that is a JSON schema of n `$ref`s (%json)."""
    return "start: %json " + json.dumps(ref_chain_short(n))


SCHEMAS = [ref_chain, ref_chain_short, property_chain, anchor_chain]
GRAMMARS = [rule_chain, rule_chain_short, terminal_chain, embedded_ref_chain]


def size(spec) -> int:
    return len(spec) if isinstance(spec, str) else len(json.dumps(spec))


def largest(make, limit: int) -> int:
    """The largest n whose make(n) is at most `limit` characters."""
    lo, hi = 1, 2
    while size(make(hi)) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(make(mid)) <= limit else (lo, mid)
    return lo
