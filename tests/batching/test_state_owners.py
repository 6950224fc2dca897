"""Each field of a sequence has one writer: the scheduler writes a Sequence's own fields, the output processor its
OutputState. Read from the package's source with `ast` (no imports): any other module that assigns one of these
attributes (=, +=, del, or a list method that changes it in place) fails, naming the module, line and field."""
import ast
import pathlib

import jaxserve

PACKAGE = pathlib.Path(jaxserve.__file__).parent

# Sequence fields that change while it runs -> their one owner: the modules that may change them. The scheduler is
# its module and the two its class builds on (admission, then what a running sequence holds).
SCHEDULER = ("batching/scheduler.py", "batching/admission.py", "batching/residency.py")
OUTPUT_PROCESSOR = ("batching/output_processor.py",)
OWNERS = {
    **dict.fromkeys(["output_token_ids", "status", "boost", "waited_steps", "num_preemptions", "pages", "page_keys",
                     "num_published", "num_cached", "num_written", "num_draft_cached", "num_cached_prompt_tokens",
                     "pending", "slot", "lora_slot", "first_scheduled_time", "first_token_time", "finish_time",
                     "token_ids_array"],
                    SCHEDULER),
    # OutputState's, reached as `seq.output.<field>` or through a local `out = seq.output`.
    **dict.fromkeys(["num_tokens", "text", "sent", "finish_reason", "stop_reason", "cumulative_logprob",
                     "logprobs", "grammar", "prompt_logprobs"], OUTPUT_PROCESSOR),
}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"}


def _targets(node):
    if isinstance(node, (ast.Assign, ast.Delete)):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return [node.func.value]
    return []


def _written_fields(target):
    """Attribute names a target writes: `x.f = `, `x.f[i] = `, `del x.f[i:]`, `a, x.f = `."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _written_fields(t)
    elif isinstance(target, ast.Subscript):
        yield from _written_fields(target.value)
    elif isinstance(target, ast.Attribute):
        yield target.attr, target


def _constructor_lines(tree) -> set[int]:
    """Lines of the __init__ methods in a module: a Sequence's constructor sets its first values."""
    return {line for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
            for line in range(f.lineno, f.end_lineno + 1)}


def test_only_the_owner_writes_a_sequence_field():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), module)
        constructing = _constructor_lines(tree) if module == "batching/sequence.py" else set()
        for node in ast.walk(tree):
            for target in _targets(node):
                for field, attr in _written_fields(target):
                    owner = OWNERS.get(field)
                    if owner is None or module in owner or node.lineno in constructing:
                        continue
                    # `self.x = ...` in a class of its own is that class's field, not a sequence's.
                    if isinstance(attr.value, ast.Name) and attr.value.id == "self":
                        continue
                    wrong.append(f"{module}:{node.lineno} writes .{field} (only {' or '.join(owner)} may)")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_write():
    """The walk finds the writes it is meant to: a scheduler-owned and an output-owned field, written elsewhere."""
    tree = ast.parse("seq.pages += [1]\nseq.output.text = ''\ndel seq.pages[2:]\nseq.output_token_ids.append(3)\n")
    found = [f for node in ast.walk(tree) for t in _targets(node) for f, _ in _written_fields(t)]
    assert sorted(found) == ["output_token_ids", "pages", "pages", "text"]
