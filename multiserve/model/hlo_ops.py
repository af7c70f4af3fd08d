"""What a compiled program's optimized HLO moves, op by op: the largest contributors and
the collectives (`multiserve doctor --target tpu --compile`, model/target_compile.py).

The compiler's own `cost_analysis()` gives totals only. This reads the optimized HLO text
(`Compiled.as_text()`) of the computations that run at the top level (the entry, and the
bodies and conditions of its loops and the branches of its conditionals, recursively;
never a fusion's or a reducer's inner computation) and, for each instruction there, the
bytes of its operands and of its result (a fusion's operands are what it reads, its
result what it writes). A loop body's instructions are multiplied by the loop's trip
count where the compiler knows it (`known_trip_count`); the compiler's own total counts
a loop body once.

Labels: the opcode; a fusion as `fusion(<its root op>)` (so the K/V writes show as
`fusion(scatter)` or `fusion(dynamic-update-slice)`), a custom call as
`custom-call(<target>)` (a Pallas TPU kernel: `tpu_custom_call`, whose bytes here are
its operands' and result's whole: what it reads of them is its CostEstimate's). A slice
counts the bytes it reads and writes (its result's, twice); an in-place update (a
scatter or dynamic-update-slice into a donated pool: its result the shape of the operand
it updates) counts its update's bytes, read and written, not the buffer's.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

# bytes of one element of each HLO element type
_ITEM = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
         "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
         "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = {"body": "loop", "condition": "loop", "true_computation": "branch",
           "false_computation": "branch"}
_NO_BYTES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
             "after-all", "partition-id", "replica-id"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute", "collective-broadcast")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (an array or a tuple of arrays) as the HLO text writes it."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _ITEM.get(dtype, 4)
    return total


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: str  # the result's shape text
    operands: tuple[str, ...]
    attributes: str  # the text after the operand list
    root: bool
    operands_text: str = ""  # the operand list as written (a parameter's number)


@dataclass(frozen=True)
class OpBytes:
    """One label's total over the program: how many instructions (times their loops' trip
    counts) and the bytes of their operands and results."""

    label: str
    count: int
    bytes: int


@dataclass(frozen=True)
class Collective:
    """One collective of the program (once per execution of its computation)."""

    opcode: str
    dtype: str
    bytes: int  # of its result
    times: int  # executions per program run (loop trip counts)


@dataclass(frozen=True)
class HloOps:
    """A compiled program's ops, as this module reads them."""

    ops: tuple[OpBytes, ...]  # largest first
    collectives: tuple[Collective, ...]
    pallas_calls: int  # Mosaic kernel call sites (tpu_custom_call), trip counts applied
    loops: int  # while loops at the top level
    unknown_trip_counts: int  # loops whose trip count the compiler does not state


def _split_operands(text: str) -> tuple[str, str]:
    """(the operand list, the attributes after it) of an instruction's text after the
    opcode's opening parenthesis."""
    depth = 1
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return text[:i], text[i + 1:]
    return text, ""


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation name: its instructions} of an HLO module's text, and the entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry = ""
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = computations.setdefault(m.group(2), [])
                if m.group(1):
                    entry = m.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            operands, attributes = _split_operands(m.group(5))
            current.append(Instruction(m.group(2), m.group(4), m.group(3),
                                       tuple(_OPERAND.findall(operands)), attributes,
                                       bool(m.group(1)), operands.strip()))
    return computations, entry


def _called(attributes: str) -> list[tuple[str, str]]:
    """(computation, how it is called) of the top-level computations an instruction runs."""
    out = []
    for key, how in _CALLED.items():
        for m in re.finditer(rf"\b{key}=%?([\w.\-]+)", attributes):
            out.append((m.group(1), how))
    m = re.search(r"branch_computations=\{([^}]*)\}", attributes)
    if m:
        out += [(c.strip().lstrip("%"), "branch") for c in m.group(1).split(",") if c.strip()]
    return out


def _trip_count(attributes: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
    return int(m.group(1)) if m else None


def _label(ins: Instruction, computations: dict[str, list[Instruction]]) -> str:
    if ins.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", ins.attributes)
        body = computations.get(m.group(1), []) if m else []
        root = next((i.opcode for i in body if i.root), "?")
        return f"fusion({root})"
    if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.attributes)
        return f"custom-call({m.group(1) if m else '?'})"
    return ins.opcode


_SLICES = ("slice", "dynamic-slice")
_UPDATES = ("dynamic-update-slice", "scatter")


def _fusion_reads(ins: Instruction, computations: dict[str, list[Instruction]],
                  sizes: dict[str, int]) -> list[int]:
    """The bytes a fusion reads of each operand: the whole operand, or where the fused
    computation only slices it (every use of its parameter a slice, directly or in a
    nested fusion), the slices."""
    reads = [sizes.get(o, 0) for o in ins.operands]
    for pos in range(len(reads)):
        sliced = _sliced_read(ins, pos, computations)
        if sliced is not None:
            reads[pos] = min(reads[pos], sliced)
    return reads


def _sliced_read(fusion: Instruction, pos: int,
                 computations: dict[str, list[Instruction]]) -> int | None:
    """The bytes `fusion` reads of its operand `pos` where it only slices it, else None."""
    m = re.search(r"calls=%?([\w.\-]+)", fusion.attributes)
    body = computations.get(m.group(1), []) if m else []
    param = next((i for i in body if i.opcode == "parameter"
                  and _parameter_number(i) == pos), None)
    if param is None:
        return None
    total = 0
    for user in (u for u in body if param.name in u.operands):
        if user.opcode in _SLICES:
            total += shape_bytes(user.shape)
        elif user.opcode == "fusion" and user.operands.count(param.name) == 1:
            inner = _sliced_read(user, user.operands.index(param.name), computations)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total if total else None


def _parameter_number(ins: Instruction) -> int | None:
    """n of a fused computation's `parameter(n)`."""
    return int(ins.operands_text) if ins.operands_text.isdigit() else None


def _moved(ins: Instruction, label: str, sizes: dict[str, int],
           computations: dict[str, list[Instruction]]) -> int:
    """The bytes one execution of `ins` reads and writes (module docstring): its operands
    and its result; a slice at its result (read, then written); an in-place update (its
    result the shape of its largest operand, which it updates) at its other operands
    (read, then written into the buffer); an asynchronous op at its start, at the smaller
    of its start's arrays (read and written), its done at nothing."""
    if ins.opcode.endswith("-done"):
        return 0
    out = shape_bytes(ins.shape)
    operands = [sizes.get(o, 0) for o in ins.operands]
    root = label.removeprefix("fusion(").removesuffix(")")
    if ins.opcode.endswith("-start"):
        arrays = [shape_bytes(f"{t}[{d}]") for t, d in _ARRAY.findall(ins.shape) if d]
        return 2 * min(arrays) if arrays else out
    if root in _SLICES:
        return 2 * out
    if root in _UPDATES and operands and out == max(operands):
        return 2 * (sum(operands) - max(operands))
    if ins.opcode == "fusion":
        operands = _fusion_reads(ins, computations, sizes)
    return out + sum(operands)


def hlo_ops(text: str, top: int = 12) -> HloOps:
    """The ops of an optimized HLO module's text (module docstring): the `top` largest
    labels by bytes, every collective, the Mosaic kernel calls and the loops."""
    computations, entry = parse(text)
    by_label: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    collectives: list[Collective] = []
    pallas = loops = unknown = 0
    seen: set[tuple[str, int]] = set()

    def visit(name: str, times: int) -> None:
        nonlocal pallas, loops, unknown
        if (name, times) in seen:
            return
        seen.add((name, times))
        body = computations.get(name, [])
        sizes = {i.name: shape_bytes(i.shape) for i in body}
        for ins in body:
            if ins.opcode == "while":
                loops += 1
                n = _trip_count(ins.attributes)
                unknown += n is None
                for called, _ in _called(ins.attributes):
                    visit(called, times * (n or 1))
                continue
            for called, _ in _called(ins.attributes):
                visit(called, times)
            if ins.opcode in _NO_BYTES or ins.opcode == "conditional":
                continue
            label = _label(ins, computations)
            moved = _moved(ins, label, sizes, computations)
            by_label[label] += moved * times
            counts[label] += times
            if label == "custom-call(tpu_custom_call)":
                pallas += times
            base = ins.opcode.removesuffix("-start").removesuffix("-done")
            if base in COLLECTIVES and not ins.opcode.endswith("-done"):
                dtypes = _ARRAY.findall(ins.shape)
                collectives.append(Collective(base, dtypes[-1][0] if dtypes else "?",
                                              shape_bytes(ins.shape), times))

    visit(entry, 1)
    ops = tuple(OpBytes(label, counts[label], b) for label, b in by_label.most_common(top))
    return HloOps(ops, tuple(collectives), pallas, loops, unknown)
