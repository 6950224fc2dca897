"""The collectives of a compiled program, read from its HLO text: what a tensor-parallel step moves between devices,
and whether that is only what the split implies (activations reduced after each row-parallel layer, per-row values
of the vocab-parallel sampler) and never the logits, a whole weight or a cache array."""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from jaxserve.cache import init_kv_cache
from jaxserve.config import ModelConfig
from jaxserve.sampling_params import MAX_LOGPROBS

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
# Bytes per element of each HLO dtype (int4 packs two a byte); the HBM audit sizes its buffers with it too.
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
# An HLO instruction: "%name = TYPE opcode(operands), attributes" (TYPE may be a tuple, with TPU layouts in it).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (per device): its kind (async "-start" forms under their kind) and the
    arrays it produces (several for a combined one; an async start's tuple holds its operands too)."""
    kind: str
    arrays: tuple  # ((dtype, dims), ...)
    is_async: bool = False
    # The conditional branches it sits in, outermost first: ((conditional, branch index), ...). Collectives in
    # different branches of one conditional never both run (see `most_in_one_run`).
    branches: tuple = ()

    @staticmethod
    def array_bytes(array) -> int:
        return int(DTYPE_BYTES[array[0]] * math.prod(array[1]))

    @property
    def bytes(self) -> int:
        """The largest array's (an all-gather's output)."""
        return max(map(self.array_bytes, self.arrays))

    def __str__(self) -> str:
        arrays = ", ".join(f"{d}[{','.join(map(str, dims))}]" for d, dims in self.arrays)
        return f"{self.kind}{' (async)' if self.is_async else ''} {arrays}"


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}|true_computation=%?(?P<true>[\w.\-]+), "
                       r"false_computation=%?(?P<false>[\w.\-]+)")


def collective_census(hlo_text: str) -> list[Collective]:
    """Every collective in a compiled program's HLO (`compiled.as_text()`), fused and async forms included: an
    "all-gather-start" counts as one all-gather (its "-done" not again), and a collective wrapped in an
    "async-start" computation is found as itself in that computation. Each knows the conditional branches it is
    in (XLA:GPU, for one, puts a copy of a collective in each branch of a cond)."""
    found = []  # (computation, Collective)
    callees = collections.defaultdict(list)  # computation -> [(callee, (conditional, branch) or None)]
    computation, entry = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("(")[0]:
            computation = header["name"]
            if line.startswith("ENTRY"):
                entry = computation
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        for call in _CALLS.finditer(line):
            callees[computation].append((call["name"], None))
        branches = _BRANCHES.search(line)
        if branches:
            names = ([n.strip().lstrip("%") for n in branches["names"].split(",")] if branches["names"] is not None
                     else [branches["true"], branches["false"]])
            name = line.split("=")[0].strip().removeprefix("ROOT").strip().lstrip("%")
            callees[computation] += [(b, (name, i)) for i, b in enumerate(names)]
        op = m["op"]
        is_async = op.endswith("-start")
        kind = op[:-len("-start")] if is_async else op
        if kind not in COLLECTIVES:
            continue
        arrays = tuple((a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
                       for a in _ARRAY.finditer(m["type"]) if a["dtype"] in DTYPE_BYTES)
        if arrays:
            found.append((computation, Collective(kind, arrays, is_async)))
    paths, todo = {entry: ()}, [entry]  # computation -> the branches on the way to it from the entry
    while todo:
        caller = todo.pop()
        for callee, branch in callees.get(caller, []):
            if callee not in paths:
                paths[callee] = paths[caller] + ((branch,) if branch else ())
                todo.append(callee)
    return [dataclasses.replace(c, branches=paths.get(comp, ())) for comp, c in found]


def most_in_one_run(collectives) -> int:
    """How many of these collectives one run of the program can execute at most: of those in the branches of a
    conditional, only one branch's count."""
    direct = [c for c in collectives if not c.branches]
    conditionals = collections.defaultdict(lambda: collections.defaultdict(list))
    for c in collectives:
        if c.branches:
            (conditional, branch), rest = c.branches[0], c.branches[1:]
            conditionals[conditional][branch].append(dataclasses.replace(c, branches=rest))
    return len(direct) + sum(max(most_in_one_run(cs) for cs in branches.values())
                             for branches in conditionals.values())


def collective_problems(compiled, config: ModelConfig, params, num_pages: int, page_size: int = 16,
                        kv_cache_dtype: str = "auto", num_speculative_tokens: int = 0,
                        head_dim_multiple: int = 1, draft_vocab_size: int = 0, feature_size: int = 0) -> list[str]:
    """What is unexpected in a tensor-parallel program's collectives (`compile_serving`'s record; config and params
    as compiled, i.e. `tensor_parallel_config`'s). Expected: a step reduces its [tokens, hidden] activations once
    after each row-parallel layer (o_proj, down_proj) and once after the vocab-split embedding (2 x layers + 1; an
    all-reduce, or a reduce-scatter whose all-gather completes it), and otherwise moves only small per-row values:
    the vocab-parallel sampler's and prompt scorer's maxima, sums and counts, and each device's top MAX_LOGPROBS
    (`jaxserve.sample.sampling`, `jaxserve.sample.prompt_logprobs`), at most tp x MAX_LOGPROBS values a row or token; a
    cache write moves nothing. Unexpected: any other count of activation reductions, any other collective bigger than
    those per-row values (logits gathered: even one row's slice of the vocabulary is bigger), and any of a whole
    weight's or cache page array's size (a weight or the cache gathered). draft_vocab_size: a speculative head's
    program (config: its layer's), which gathers its rows' draft logits [rows, draft_vocab_size] once, to scatter
    each device's slice of the target vocabulary from them (`jaxserve.runner.head_steps.target_logits`), and reduces
    its fc's products over the captured features [tokens, feature_size], split by column (XLA:GPU at one token sums
    the features' row itself instead, once for the embedding's reduction and fc's)."""
    if compiled.error or compiled.tensor_parallel_size == 1:
        return []
    census = compiled.census
    if compiled.program.endswith("cache write"):
        return [f"a cache write has collectives: {', '.join(map(str, census))}"] if census else []
    tokens, _, _, rows, _ = compiled.shape.split()
    tokens, rows = int(tokens), int(rows)
    tp = compiled.tensor_parallel_size
    scored = rows * (num_speculative_tokens + 1 if compiled.program == "verify step" else 1)
    numel = {"activations": tokens * config.hidden_size, "logits": scored * config.vocab_size}
    # The most values the rows (or the prompt scorer's tokens) exchange; below one row's vocabulary slice at
    # serving shapes (Llama 3 8B, 64 tokens over 8 devices: 10240 against 16032), so a row of logits shows.
    per_row = max(tokens, scored) * tp * MAX_LOGPROBS
    # A head's draft logits gathered: the whole, and (an async start's tuple holds its operand) one device's part.
    draft = {scored * draft_vocab_size, scored * draft_vocab_size // tp} if draft_vocab_size else set()
    problems = []
    # (one collective may reduce several arrays: a combined all-reduce counts once per activation array in it)
    # (a one-token step's row-parallel products on GPU are of two rows, the second zero: jaxserve.model.quant.matmul)
    activations = {numel["activations"], (2 if tokens == 1 else 1) * numel["activations"]}
    row_of_features = tokens * feature_size if feature_size else None
    folded = any(math.prod(dims) == row_of_features for c in census if c.kind == "all-reduce" for _, dims in c.arrays)
    reductions = folded + most_in_one_run(
        [c for c in census if c.kind == "all-reduce" for _, dims in c.arrays if math.prod(dims) in activations]
        + [c for c in census if c.kind == "reduce-scatter" for _, dims in c.arrays[-1:]
           if math.prod(dims) * tp in activations])
    # A head also reduces its fc's products over the captured features, which are split by column (or, folded,
    # the features' row once for that and the embedding's).
    expected = 2 * config.num_layers + 1 + bool(draft_vocab_size) - folded
    if reductions != expected:
        problems.append(f"{reductions} reductions of the [{tokens}, {config.hidden_size}] activations, expected "
                        f"{expected} (2 per layer + the embedding{' + the head fc' if draft_vocab_size else ''})")
    kv = jax.eval_shape(lambda: init_kv_cache(config, num_pages, page_size, jnp.bfloat16, kv_cache_dtype,
                                              head_dim_multiple))
    named = [("/".join(str(getattr(k, "key", k)) for k in path[-2:]), x.shape)
             for path, x in jax.tree_util.tree_leaves_with_path(params) if x.ndim > 1]
    named += [("KV cache pages", x.shape) for x in jax.tree.leaves(kv) if x.ndim > 1]
    by_shape, whole = {}, {}  # a whole weight's or page array's shape (first), or its size: its name
    for name, shape in named:
        if math.prod(shape) not in numel.values():
            by_shape.setdefault(shape, name)
            whole.setdefault(math.prod(shape), name)
    for c in census:
        for array in c.arrays:
            size = math.prod(array[1])
            if array[1] in by_shape or size in whole:
                problems.append(f"{c.kind} of a whole {by_shape.get(array[1]) or whole[size]}: {c}")
            elif size > per_row and size not in activations and size not in draft and size != row_of_features:
                what = "the logits" if size == numel["logits"] else f"{per_row} per-row values"
                problems.append(f"{c.kind} bigger than {what}: {c}")
    return problems
