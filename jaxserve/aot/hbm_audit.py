"""The HBM traffic of a compiled program beyond what it must move, read from its HLO text: every instruction that
materialises a weight- or KV-cache-sized buffer in HBM (a relayout, copy, transpose, convert, a gather of a whole
weight, a fusion whose output is as big as a weight), outside the attention kernel's custom call and the cache
write's in-place update.

What a step must move is each weight read once by the dot consuming it, the pages the attention kernel reads, and
the new tokens' K/V written in place. Anything else of that size is an extra pass over HBM per step: the KV cache
copied into the layout a kernel wants, an int8 weight widened to a bf16 temporary before its dot. Instructions
inside fused computations never touch HBM (only a fusion's operands and output do), so only unfused computations
(the entry, loop bodies, conditional branches) are read. TPU's on-chip memory (layout memory space S(1), VMEM) is
not HBM: a weight prefetched into it is the dot's own read, not an extra one, and what moves within it moves no HBM
bytes; but the whole cache, or the whole embedding table, moved into it is read whole (the kernel reads only the
pages its rows use, the lookup only its tokens' rows).

An in-place update (dynamic-update-slice, scatter, or a fusion rooted in one) is never listed itself: XLA updates
its operand's buffer, and when that cannot be the argument's (donation lost, a layout changed) it inserts a `copy`
before it, which is listed.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax

from jaxserve.aot.collectives import COLLECTIVES, DTYPE_BYTES
from jaxserve.parallel.layouts import ROW_TABLES

# "name = TYPE opcode(operands), attributes"; TYPE may be a tuple (with TPU layouts, memory spaces in it).
_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][\w\-]*)\("
                          r"(?P<rest>.*)$")
# dtype[dims]{minor_to_major:tiling...S(memory space)}; the layout is absent in some dumps.
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z0-9]*)\[(?P<dims>[\d,]*)\](?:\{(?P<layout>[^}]*)\})?")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|called_computations|body|condition)=\{?%?(?P<name>[\w.\-]+)")
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]*)"')

# Views, control flow and bookkeeping: no buffer of their own (a while's or conditional's tuple aliases its
# operands; "-done" halves of async pairs repeat their "-start"'s buffer).
_NO_BUFFER = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota"}
_UPDATES = {"dynamic-update-slice", "scatter"}
# Custom calls that are the attention kernel (Mosaic on TPU, Triton on GPU), or TPU's own views and allocations.
KERNEL_TARGETS = {"tpu_custom_call", "__gpu$xla.gpu.triton"}
_VIEW_TARGETS = {"ConcatBitcast", "AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked"}
ON_CHIP_MEMORY_SPACE = "1"  # TPU VMEM
_PACKED = {"u8", "s4", "u4"}  # dtypes a packed int4 weight can arrive in
_NOT_WEIGHTS = {"scale", "offset", "input_scale"}  # a quantized weight's (jaxserve.model.quant)


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple
    layout: str = ""  # e.g. "3,2,1,0:T(4,128)(2,1)S(1)"

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return int(DTYPE_BYTES.get(self.dtype, 0) * self.numel)

    @property
    def memory_space(self) -> str:
        m = re.search(r"S\((\d+)\)", self.layout)
        return m.group(1) if m else "0"

    @property
    def placement(self) -> str:
        """The layout without its memory space: minor-to-major order and tiling."""
        return re.sub(r"S\(\d+\)", "", self.layout)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]" + (f"{{{self.layout}}}" if self.layout else "")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A weight or a KV cache array as one device holds it: what the audit looks for."""
    name: str  # e.g. "layers_0/q_proj/kernel", "KV cache pages"
    dims: tuple  # per device
    bytes: int
    is_cache: bool = False
    is_table: bool = False  # an embedding table: read a row at a time (by a lookup), not whole (by a dot)

    @property
    def numel(self) -> int:
        return math.prod(self.dims)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One instruction that writes a weight- or cache-sized buffer to HBM it did not have to."""
    kind: str  # "relayout", "copy", "transpose", "convert", "bitcast-convert", "gather", "slice", "fusion", ...
    instruction: str  # its HLO name
    array: Array  # what it writes
    of: str  # the buffer it is the size of, or reads from
    source: str = ""  # the operand it reads, when that says more (a relayout's from-layout)

    @property
    def bytes(self) -> int:
        """Bytes written (a copy also reads as many)."""
        return self.array.bytes

    def __str__(self) -> str:
        return (f"{self.kind} of {self.of}: {self.instruction} = {self.array}"
                + (f" <- {self.source}" if self.source else "") + f" ({self.bytes / 1e6:.1f} MB)")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    op: str
    arrays: tuple  # Arrays of its type, in order (a tuple's flattened)
    operands: tuple  # operand names
    calls: tuple  # computations it calls
    target: str | None  # custom-call target
    is_root: bool
    op_name: str = ""  # a parameter's: the argument's path, e.g. "params['params']['layers_0']['q_proj']['kernel']"

    @property
    def outputs(self) -> tuple:
        """The buffers it writes: an async copy's destination (its tuple's first), an async slice's (its second,
        after the operand), each array of a multi-output fusion's tuple."""
        if self.op == "copy-start":
            return self.arrays[:1]
        if self.op == "slice-start":
            return self.arrays[1:2]
        return self.arrays


def parse(hlo_text: str) -> tuple[dict, str | None]:
    """{computation: [instructions]} and the entry's name."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            header = _COMPUTATION.match(line)
            if header:
                current = header["name"]
                computations[current] = []
                entry = current if header["entry"] else entry
            continue
        if current is None:
            continue
        rest, depth = m["rest"], 1
        for end, c in enumerate(rest):  # the operand list ends at its closing parenthesis
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
        operands, attributes = rest[:end], rest[end:]
        target = _TARGET.search(attributes)
        computations[current].append(_Instruction(
            m["name"], m["op"],
            tuple(Array(a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d), a["layout"] or "")
                  for a in _ARRAY.finditer(m["type"]) if a["dtype"] in DTYPE_BYTES),
            tuple(o["name"] for o in _OPERAND.finditer(operands)),
            tuple(c["name"] for c in _CALLS.finditer(attributes)) + tuple(
                n.strip().lstrip("%") for b in re.findall(r"branch_computations=\{([^}]*)\}", attributes)
                for n in b.split(",")),
            target["target"] if target else None, bool(m["root"]),
            (_OP_NAME.search(attributes) or {"name": ""})["name"].replace("\\", "") if m["op"] == "parameter" else ""))
    return computations, entry


def _unfused(computations: dict, entry: str) -> list:
    """The computations reachable from the entry other than through a fusion (loop bodies, branches, calls): the
    ones whose instructions read and write HBM."""
    found, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name not in found and name in computations:
            found.append(name)
            todo += [c for i in computations[name] if i.op != "fusion" for c in i.calls]
    return found


def _root(instructions) -> _Instruction | None:
    return next((i for i in instructions if i.is_root), None)


def audit(hlo_text: str, buffers: list[Buffer], threshold: int | None = None) -> list[Traffic]:
    """Every instruction of a compiled program (`compiled.as_text()`) outside fusions that writes to HBM a buffer
    the size (element count) of one of `buffers`, or at least `threshold` bytes read out of one (a slice, a copy of
    part of a page array); by default the threshold is the smallest buffer's bytes. Not listed: the attention
    kernel's custom call, in-place updates, views (bitcasts, tuples), moves within TPU VMEM and a weight's prefetch
    into it, collectives (see jaxserve.aot.collectives)."""
    computations, entry = parse(hlo_text)
    by_name = {i.name: i for cs in computations.values() for i in cs}
    shaped, sized = {}, {}  # dims or numel -> the first buffer of that shape or size
    for b in sorted(buffers, key=lambda b: (not b.is_cache, b.name)):
        shaped.setdefault(b.dims, b)
        sized.setdefault(b.numel, b)
    threshold = min((b.bytes for b in buffers), default=0) if threshold is None else threshold

    def of(array: Array | None) -> Buffer | None:
        """The buffer of its shape, or else of its size (a reshaped or transposed one)."""
        return None if array is None else shaped.get(array.dims) or sized.get(array.numel)

    found = []
    for computation in _unfused(computations, entry):
        for i in computations[computation]:
            if (i.op in _NO_BUFFER or i.op.endswith("-done") or i.op in COLLECTIVES
                    or i.op.removesuffix("-start") in COLLECTIVES):
                continue
            if i.op == "custom-call" and (i.target in KERNEL_TARGETS or i.target in _VIEW_TARGETS):
                continue
            root = _root(computations.get(i.calls[0], [])) if i.op == "fusion" and i.calls else None
            if i.op in _UPDATES or (root is not None and root.op in _UPDATES):
                continue
            # what it reads: its largest operand (through a tuple-valued one, its largest array)
            source = max((a for o in i.operands if o in by_name for a in by_name[o].outputs),
                         key=lambda a: a.numel, default=None)
            # an entry argument it reads, by name ("layers_0/q_proj/kernel")
            arguments = collections.defaultdict(list)  # numel -> names, in operand order
            for o in i.operands:
                if o in by_name and by_name[o].op_name:
                    name = "/".join(re.findall(r"\['([^']*)'\]", by_name[o].op_name)[-3:])
                    for a in by_name[o].outputs:
                        arguments[a.numel].append(name)
                        if a.dtype in _PACKED:  # two int4 values a byte: what it unpacks to
                            arguments[2 * a.numel].append(name + " (unpacked)")
            read = {n for a in (a for o in i.operands if o in by_name for a in by_name[o].outputs)
                    for n in ((a.numel, 2 * a.numel) if a.dtype in _PACKED else (a.numel,))}
            for out in i.outputs:
                if out.bytes < threshold:
                    continue
                buffer = of(out)
                if buffer is not None and out.dims != buffer.dims and out.numel not in read:
                    # of a weight's size but not its shape, from nothing of that size: a product of other arrays
                    # (e.g. a GEMM's [16, 16, 256] output beside a [256, 256] weight), not a copy of one
                    buffer = None
                if buffer is None and i.op != "fusion":
                    buffer = of(source)  # part of a weight or page array, e.g. a slice of it
                if buffer is None:
                    continue
                kind = i.op.removesuffix("-start")
                if kind == "copy" and source is not None and source.numel == out.numel:
                    kind = "relayout" if source.placement != out.placement else kind
                elif kind == "fusion" and root is not None and root.op != "tuple":
                    kind = f"fusion ({root.op})"
                # TPU VMEM: from VMEM, no HBM traffic; from HBM, a weight moved as it is is its dot's own read, but
                # the cache or an embedding table moved whole is not (the kernel reads only the pages its rows use,
                # the lookup its tokens' rows), nor is a relayout.
                if out.memory_space == ON_CHIP_MEMORY_SPACE and (
                        source is None or source.memory_space == ON_CHIP_MEMORY_SPACE
                        or (kind != "relayout" and not (buffer.is_cache or buffer.is_table))):
                    continue
                if (kind == "copy" and source.memory_space == ON_CHIP_MEMORY_SPACE != out.memory_space
                        and not buffer.is_cache):
                    continue  # a weight out of VMEM into HBM as it was: written back, not a second copy
                name = buffer.name
                if arguments[out.numel] and not buffer.is_cache:
                    name = arguments[out.numel].pop(0) or name
                found.append(Traffic(kind, i.name, out, name, str(source) if kind == "relayout" else ""))
    return found


def buffers(tree, *, cache: bool = False) -> list[Buffer]:
    """The weight (or, with cache=True, KV page) arrays of a pytree of ShapeDtypeStructs, per device where they
    carry a sharding; vectors (norms) and a quantized weight's scales left out. A packed int4 weight also counts at
    its unpacked size (two values a byte): what a dequantized copy of it would be."""
    found = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        last = keys[-1] if keys else ""
        if len(x.shape) < 2 or last in _NOT_WEIGHTS:
            continue
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        name = "KV cache pages" if cache else "/".join(k for k in keys if k != "params")
        found.append(Buffer(name, tuple(shape), int(math.prod(shape) * x.dtype.itemsize), cache,
                            not cache and any(k in ROW_TABLES for k in keys)))
        if last == "packed":
            unpacked = (2 * shape[0], *shape[1:])
            found.append(Buffer(name.removesuffix("/packed") + " (unpacked)", unpacked, math.prod(unpacked), cache))
    return found

