"""Indexed ops inside pointwise kernels: `cat`, `slice_scatter`, `slice_backward`,
`constant_pad_nd`, `take` (the op table's `indexed` category) and the `slice`s of
values a kernel computes.

A pointwise kernel computes its root at each element of its shape. An indexed op
reads an operand at another position: cat's piece k at the element's index less
the sizes of the pieces before it along the cat's dim, a slice at its index plus
the slice's start, a pad's element at its index less the padding before it (or
the fill value outside its operand). So here a body term is computed at a *point*: per dim of the
kernel's shape, the element's index shifted by a constant (`pos3 - 8`), or a
constant (a dim the term has size 1 in, which it broadcasts). The root is computed
at the element itself and each op asks for its operands at the points it reads
them, so a term read at two points (the two halves of a rotary embedding's input)
is computed twice, and an input is loaded once per point. A load whose point may
leave its input (a cat's piece beyond its range) is masked there; the op that reads
it selects, by the element's index, the operand that holds the element
(`where(pos3 < 8, piece0, piece1)`), so a masked value is never used. Values are
copied, never computed, by these ops: a fused chain gives eager's values.

A take (an embedding lookup) reads x at a coordinate that is a value: the index,
loaded at the element, names x's position along the take's dim (a *dynamic*
coordinate: pinned to a variable, not a constant). Both operands of a take are
kernel inputs (kinds/pointwise.py), and an index outside [0, size) is an error as in
eager: the OpenMP launcher checks the index inputs before the launch (`bounds`,
runtime/launch.py); a Triton kernel asserts it on the device (compiled with
Triton's `debug` on, as Inductor compiles its gathers) and masks the load.

Over static shapes only (`fits`): the pieces' offsets are constants in the source.
Kernels with none of these ops never come here (kinds/pointwise.py renders them
one statement per term); those with one read every input through its strides
(`spec_of`), which the launcher passes for any input shape (runtime/launch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.fuse import INTS, static_shape
from ..engine.ops import OpTable
from ..engine.term import Term
from .kernels import (
    CPP_DTYPES,
    MOVES,
    aligned_shape,
    cpp_value_type,
    cpp_read,
    RenderError,
    literal,
    pad_widths,
    take_dim,
    triton_load,
    triton_take_assert,
    value_expr,
)
from .spec import KernelSpec

# Per dim of the kernel's shape: (pinned, value). Pinned: the constant `value`, or
# the variable it names (a dynamic coordinate: a take's index); else the element's
# index along the dim plus `value`.
Coord = tuple[bool, Any]
Point = tuple[Coord, ...]


def _bounds(start: Any, end: Any, size: int) -> tuple[int, int]:
    """A slice's [start, end) along a dim of `size`, as ATen clamps it."""
    s = 0 if start is None else start + size if start < 0 else start
    e = size if end is None else end + size if end < 0 else end
    s = min(max(s, 0), size)
    return s, min(max(e, s), size)


def fits(t: Term, shape: tuple[Any, ...]) -> bool:
    """Whether a pointwise kernel of `shape` may compute `t` at the points an indexed
    op reads it: both static, `t` of no higher rank."""
    return static_shape(shape) and static_shape(t.meta.shape) and t.meta.rank <= len(shape)


@dataclass
class _Load:
    """Input `k` (of `size`, aligned to the kernel's rank) read at `point` into
    variable `name`."""

    k: int
    size: tuple[int, ...]
    point: Point
    name: str


@dataclass
class Plan:
    """Which body term a kernel computes at which point, in the order it needs them:
    the loads (`loads`) and the statements (`stmts`: variable, expression, dtype), and
    the variable (or literal) holding each written term at the element itself
    (`outputs`). `target` spells conditions and selections; dims are named by their
    position in the kernel's space (`pos{p}`: the element's index there; the
    launcher lays the space out in the output's memory order, `perm`)."""

    spec: KernelSpec
    target: str
    table: OpTable
    shape: tuple[int, ...] = field(init=False)
    perm: list[int] = field(init=False)  # space position p holds graph dim perm[p]
    loads: list[_Load] = field(default_factory=list)
    stmts: list[tuple[str, str, str]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # each take's index variable and the size it must stay below
    checks: list[tuple[str, int]] = field(default_factory=list)
    _names: dict[tuple[Term, Point], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shape = tuple(self.spec.meta["shape"])
        order = self.spec.meta.get("order")
        self.perm = list(order) if order is not None and len(order) == len(self.shape) \
            else list(range(len(self.shape)))
        here: Point = tuple((False, 0) for _ in self.shape)
        self.outputs = [self.value(t, here) for t in self.spec.written]

    # ------------------------------------------------------------- spelling
    def pos(self, j: int) -> str:
        """The element's index along graph dim j."""
        return f"pos{self.perm.index(j)}"

    def coord(self, j: int, c: Coord) -> str:
        pinned, v = c
        if pinned:
            return str(v)
        return self.pos(j) if v == 0 else f"({self.pos(j)} {'+' if v > 0 else '-'} {abs(v)})"

    def both(self, conds: list[str]) -> str:
        """All of `conds` (comparisons, or names of bools)."""
        if len(conds) == 1:
            return conds[0]
        return (" & " if self.target == "triton" else " && ").join(f"({c})" for c in conds)

    def select(self, cond: str, a: str, b: str) -> str:
        if self.target == "triton":
            return f"tl.where({cond}, {a}, {b})"
        return f"(({cond}) ? {a} : {b})"

    def zero(self, t: Term) -> str:
        return literal(0 if t.meta.dtype in INTS else 0.0, self.target, t.meta.dtype != "f64")

    # ------------------------------------------------------------- the plan
    def value(self, t: Term, point: Point) -> str:
        """The variable (or literal) holding `t` at `point`, computing it first."""
        if t.op == "const":
            return literal(t.value, self.target, t.meta.dtype != "f64")
        rank = len(self.shape)
        size = aligned_shape(t, rank)
        # a dim `t` has size 1 in: it broadcasts, whatever the point's index there
        point = tuple((True, 0) if size[j] == 1 else c for j, c in enumerate(point))
        key = (t, point)
        if key not in self._names:
            self._names[key] = self._compute(t, point, size)
        return self._names[key]

    def _compute(self, t: Term, point: Point, size: tuple[int, ...]) -> str:
        if t.op == "arg":
            return self._load(t, point, size)
        if t.op == "constant_pad_nd":
            return self._pad(t, point)
        if t.op == "take":
            return self._take(t, point)
        if any(_dynamic(c) for c in point) and t.op in MOVES:
            raise RenderError(f"{t.op} read where a take's index points")
        if t.op in MOVES:
            rank = t.meta.rank
            j = t.attr("dim") % rank + len(self.shape) - rank
            if t.op == "slice":
                src = t.args[0]
                start, _ = _bounds(t.attr("start"), t.attr("end"),
                                   aligned_shape(src, len(self.shape))[j])
                return self.value(src, _moved(point, j, start))
            if t.op == "cat":
                return self._cat(t, point, j)
            return self._scatter(t, point, j, size)
        operands = {a: self.value(a, point) for a in t.args if a.op != "const"}
        return self._statement(value_expr(t, operands, self.target, self.table), t)

    def _statement(self, expr: str, t: Term) -> str:
        name = f"t{len(self.stmts)}"
        self.stmts.append((name, expr, t.meta.dtype))
        return name

    def _reach(self, j: int, c: Coord, size: int) -> tuple[int, int]:
        """The coordinates along graph dim j that `c` takes over the kernel's elements,
        within a term of `size` there."""
        pinned, v = c
        if _dynamic(c):
            raise RenderError("a coordinate a take's index gives has no range here")
        if pinned:
            return v, v + 1
        return max(v, 0), min(self.shape[j] + v, size)

    def _cat(self, t: Term, point: Point, j: int) -> str:
        rank = len(self.shape)
        pieces, offset = [], 0
        for a in t.args:
            n = aligned_shape(a, rank)[j]
            pieces.append((a, offset, n))
            offset += n
        lo, hi = self._reach(j, point[j], offset)
        live = [(a, off, n) for a, off, n in pieces if n > 0 and off < hi and off + n > lo]
        if not live:  # a point no element of the kernel reaches: never read
            return self.zero(t)
        v = point[j][1]  # pinned: one piece is live
        values = [self.value(a, _moved(point, j, -off)) for a, off, _ in live]
        if len(values) == 1:
            return values[0]
        expr = values[-1]
        for (_, off, n), val in zip(reversed(live[:-1]), reversed(values[:-1]), strict=True):
            expr = self.select(f"{self.pos(j)} < {off + n - v}", val, expr)
        return self._statement(expr, t)

    def _scatter(self, t: Term, point: Point, j: int, size: tuple[int, ...]) -> str:
        """slice_scatter(base, src, ...): src inside [start, end) along the dim, base
        elsewhere; slice_backward(grad, ...): the same over zeros."""
        src = t.args[-1]
        start, end = _bounds(t.attr("start"), t.attr("end"), size[j])
        lo, hi = self._reach(j, point[j], size[j])
        inside = start < hi and end > lo and end > start
        outside = lo < start or hi > end
        base = (lambda: self.zero(t)) if t.op == "slice_backward" else \
            (lambda: self.value(t.args[0], point))
        if not inside:
            return base()
        value = self.value(src, _moved(point, j, -start))
        if not outside:
            return value
        v = point[j][1]
        conds = ([f"{self.pos(j)} >= {start - v}"] if start > lo else []) + \
            ([f"{self.pos(j)} < {end - v}"] if end < hi else [])
        return self._statement(self.select(self.both(conds), value, base()), t)

    def _take(self, t: Term, point: Point) -> str:
        """take(x, index, dim): x at the element's point with its coordinate along
        `dim` the index's value there."""
        x, index = t.args
        if x.op != "arg" or index.op != "arg":
            raise RenderError("a take reads its operands from memory: both are inputs")
        rank = len(self.shape)
        j = take_dim(t, rank)
        at = self.value(index, point)
        n = aligned_shape(x, rank)[j]
        if (at, n) not in self.checks:
            self.checks.append((at, n))
        return self.value(x, point[:j] + ((True, at),) + point[j + 1:])

    def _pad(self, t: Term, point: Point) -> str:
        """constant_pad_nd(x, pad, value): x at the element's index less the padding
        before it, where that lies inside x; `value` elsewhere."""
        src, rank = t.args[0], len(self.shape)
        value = t.attr("value")
        fill = literal(int(value) if t.meta.dtype in INTS else float(value), self.target,
                       t.meta.dtype != "f64")
        size = aligned_shape(t, rank)
        conds, at = [], point
        for d, (before, _) in enumerate(pad_widths(t)):
            j = d + rank - t.meta.rank
            n = aligned_shape(src, rank)[j]
            at = _moved(at, j, -before)
            lo, hi = self._reach(j, point[j], size[j])
            if lo >= before + n or hi <= before:
                return fill  # no element of the kernel reads x here
            if point[j][0]:
                continue  # one coordinate, inside x
            v = point[j][1]
            if lo < before:
                conds.append(f"{self.pos(j)} >= {before - v}")
            if hi > before + n:
                conds.append(f"{self.pos(j)} < {before + n - v}")
        inside = self.value(src, at)
        if not conds:
            return inside
        return self._statement(self.select(self.both(conds), inside, fill), t)

    def _load(self, t: Term, point: Point, size: tuple[int, ...]) -> str:
        k = t.attr("index")
        here = all(c == (False, 0) or size[j] == 1 for j, c in enumerate(point))
        name = f"x{k}" if here else f"x{k}_{len(self.loads)}"
        self.loads.append(_Load(k, size, point, name))
        return name

    # ------------------------------------------------------------- loads
    def offset(self, load: _Load, dims: Callable[[int], bool] = lambda p: True,
               unit: bool = False, dynamic: bool = True) -> str:
        """Input k's offset at the load's point, summed over the space positions p
        that `dims` keeps and, with `dynamic`, those whose coordinate is a variable
        (wherever it is defined); `unit`: the innermost stride is 1."""
        rank = len(self.shape)
        terms = []
        for p, j in enumerate(self.perm):
            if load.size[j] == 1 or not (dynamic if _dynamic(load.point[j]) else dims(p)):
                continue  # broadcast: stride 0
            stride = f"{self.spec.inputs[load.k].name}_stride{p}"
            c = self.coord(j, load.point[j])
            terms.append(c if unit and p == rank - 1 else f"{c} * {stride}")
        return " + ".join(terms) or "0"

    def mask(self, load: _Load, dims: Callable[[int], bool] = lambda p: True,
             dynamic: bool = False) -> list[str]:
        """Conditions under which the load's point lies inside its input (at the
        space positions `dims` keeps, and with `dynamic` where a variable names the
        coordinate): empty where it always does."""
        conds = []
        for p, j in enumerate(self.perm):
            pinned, v = load.point[j]
            if dynamic and _dynamic(load.point[j]) and load.size[j] != 1:
                conds.append(self.both([f"{v} >= 0", f"{v} < {load.size[j]}"]))
            if pinned or load.size[j] == 1 or not dims(p):
                continue
            if v < 0:
                conds.append(f"{self.pos(j)} >= {-v}")
            if self.shape[j] + v > load.size[j]:
                conds.append(f"{self.pos(j)} < {load.size[j] - v}")
        return conds


def _dynamic(c: Coord) -> bool:
    """A coordinate that a variable names (a take's index)."""
    return c[0] and isinstance(c[1], str)


def _moved(point: Point, j: int, by: int) -> Point:
    pinned, v = point[j]
    return point[:j] + ((pinned, v + by),) + point[j + 1:]


def _positions(rank: int, index: str, div: str, dims: range) -> list[tuple[int, str]]:
    """Each space position p in `dims` and the element's index there, from linear
    index `index` over the positions of `dims` (sizes `size{p}`)."""
    out = []
    for p in dims:
        inner = [f"size{q}" for q in dims if q > p]
        e = index if not inner else f"({index} {div} ({' * '.join(inner)}))"
        out.append((p, e if p == dims[0] else f"{e} % size{p}"))
    return out


# ------------------------------------------------------------------------- Triton
def triton_parts(spec: KernelSpec, table: OpTable) -> tuple[list[str], list[str], list[str]]:
    """(loads, statements, output values) of a pointwise Triton kernel with indexed
    ops: the element's index per space position first, then each input at each point
    it is read at, masked where the point may leave it."""
    plan = Plan(spec, "triton", table)
    rank = len(plan.shape)
    lines = [f"pos{p} = {e}" for p, e in _positions(rank, "offs", "//", range(rank))]
    for load in plan.loads:
        conds = plan.mask(load, dynamic=True)
        mask = plan.both(["mask", *conds]) if conds else "mask"
        off = plan.offset(load)
        if "pos" not in off:  # one element for every lane: still a block, as the mask is
            off = f"{off} + 0 * offs"
        lines.append(triton_load(spec, load.k, off, mask, load.name))
    for at, n in plan.checks:
        lines.append(triton_take_assert(f"(({at} >= 0) & ({at} < {n})) | ~mask"))
    return lines, [f"{n} = {e}" for n, e, _ in plan.stmts], plan.outputs


# ------------------------------------------------------------------------- OpenMP
@dataclass
class CppParts:
    """What templates/openmp/pointwise.cpp.j2's row loop takes: per-row lines (the
    element's index at the outer positions, each load's offset there), the condition
    for the loop of plain vector loads (every read input contiguous along the row),
    that loop's lines and the strided loop's, and the output values."""

    row_body: list[str]
    unit_stride: str
    unit_body: list[str]
    body: list[str]
    outputs: list[str]


def cpp_parts(spec: KernelSpec, table: OpTable) -> CppParts:
    plan = Plan(spec, "cpp", table)
    rank = len(plan.shape)
    last = rank - 1
    ctype = CPP_DTYPES[spec.compute]
    row = [f"const int64_t pos{p} = {e};" for p, e in _positions(rank, "r", "/", range(last))]

    def outer(p: int) -> bool:
        return p < last

    def inner(p: int) -> bool:
        return p == last

    bases: dict[str, str] = {}  # a load's offset at the outer positions -> its name
    rows: dict[str, str] = {}  # a load's conditions there -> their name
    for load in plan.loads:
        base = plan.offset(load, outer, dynamic=False)
        if base not in bases:
            bases[base] = f"{load.name}_base"
            row.append(f"const int64_t {bases[base]} = {base};")
        cond = plan.both(plan.mask(load, outer))
        if cond and cond not in rows:
            rows[cond] = f"{load.name}_in"
            row.append(f"const bool {rows[cond]} = {cond};")
    loops = []  # the innermost position, then each load's line, per loop
    for unit in (True, False):
        lines = [f"const int64_t pos{last} = c;"]
        for load in plan.loads:
            inp = spec.inputs[load.k]
            base = bases[plan.offset(load, outer, dynamic=False)]
            cond = plan.both(plan.mask(load, outer))
            conds = ([rows[cond]] if cond else []) + plan.mask(load, inner)
            along = plan.offset(load, inner, unit)
            off = base if along == "0" else f"{base} + {along}"
            if conds:  # outside its input the load reads element 0, which nothing uses
                off = f"({plan.both(conds)}) ? ({off}) : 0"
            lines.append(f"const {cpp_value_type(inp.dtype, ctype)} {load.name} = "
                         f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};")
        lines += [f"const {cpp_value_type(d, ctype)} {n} = {e};" for n, e, d in plan.stmts]
        loops.append(lines)
    strided = sorted({load.k for load in plan.loads if load.size[plan.perm[last]] != 1})
    unit_stride = " && ".join(f"{spec.inputs[k].name}_stride{last} == 1" for k in strided)
    return CppParts(row, unit_stride or "true", loops[0], loops[1], plan.outputs)
