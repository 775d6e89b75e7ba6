"""The `row` kernel kind: pointwise work around reductions along one dim.

Rules fuse-row (softmax, log_softmax, layer_norm, rms_norm) and fuse-row-reduction
name it: one program per row, the row kept in registers. Its spec is built as the
pointwise kind's (kinds/kernels.py: spec_of); its render is here: Python writes
the loads, statements, reductions and stores, templates/<target>/row.*.j2 the
loops around them. On Triton a row too wide for registers runs as the
`row_looped` variant instead (kinds/row_looped.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.fuse import (
    FLOATS,
    ROW_REDUCTIONS,
    body_terms,
    broadcasts,
    kernel_value,
    reduced_dim,
)
from ..engine.ops import OpTable
from ..engine.term import Term
from .accumulators import PAIRWISE_CHUNK, cpp_accumulator
from .kernels import (
    CPP_DTYPES,
    MOVES,
    aligned_shape,
    check_template,
    cpp_value_type,
    cpp_params,
    cpp_read,
    cpp_write,
    cpp_statement,
    kernel_header,
    per_row,
    print_index,
    row_width_param,
    spec_of,
    strided_offset,
    take_dim,
    term_names,
    triton_load,
    triton_params,
    triton_take_assert,
    triton_statement,
    triton_store,
    whole,
)
from .kind import Kind
from .row_looped import PERSISTENT_ROW_MAX_COLS, looped
from .spec import KernelSpec, KInput, static_width
from .templates import render_template
from .tuning import RowTuning


class RowSpace:
    """Rows along one dim `dim` of a shape S: members are S-shaped values, one
    value per row (S with size 1 at `dim`), or values that broadcast to S (a cast of
    a norm's weights, computed where it is read), and reductions run along `dim`.
    Softmax and layer_norm reduce the last dim; a bias gradient reduces dim 0.
    Any float member may be a side output: an S-shaped one is stored with the row's
    elements, a per-row one (layer_norm's mean and rstd) once per row; a bool mask
    is not (the kernel stores floats)."""

    side_outputs = True

    def __init__(self, root: Term) -> None:
        self.dim = reduced_dim(root)
        src = root.args[0] if self.dim is not None else root
        self.shape = tuple(src.meta.shape)
        self.loaded: set[Term] = set()  # a take's operands: kernel inputs

    def per_row(self) -> tuple[Any, ...] | None:
        if self.dim is None:
            return None
        return self.shape[:self.dim] + (1,) + self.shape[self.dim + 1:]

    def fits(self, t: Term) -> bool:
        if t.op == "iota" and self.shape:  # positions along the row: the column index
            return self._along_rows(t)
        if not kernel_value(t) or not self.shape or t in self.loaded:
            return False
        if t.op in MOVES:
            return t.op == "take" and self._take(t)
        if t.op in ROW_REDUCTIONS:
            if t.meta.dtype not in FLOATS:
                return False  # a count: the reduction kind's (in f64)
            d = reduced_dim(t)
            if d is None or tuple(t.args[0].meta.shape) != self.shape:
                return False
            if self.dim is None:
                self.dim = d  # the first reduction fixes the group's row dim
            return d == self.dim
        shape = tuple(t.meta.shape)
        if self.dim is None:
            # A per-row value seen before any reduction fixes the row dim.
            self.dim = self._row_dim(shape)
        if shape in (self.shape, self.per_row()):
            return True
        # A value that broadcasts to the rows (a cast of a norm's [D] weights, a
        # [1, T, D] position table): computed at each element it is read at, from
        # inputs read through the broadcast, as a pointwise kernel computes one.
        # Never a side output (can_output): one a user outside reads stays outside.
        return broadcasts(shape, self.shape)

    def _take(self, t: Term) -> bool:
        """A take of the rows' shape, or one that broadcasts to it (positions shared
        by a batch), that picks whole rows of a table (an embedding read by a norm):
        rows along the last dim, one index per row, another dim picked, and rows no
        wider than one pass keeps in registers (Triton's looped rows read no take).
        Its operands stay kernel inputs."""
        rank = len(self.shape)
        x, index = t.args
        if not broadcasts(tuple(t.meta.shape), self.shape) or self.dim not in (None, rank - 1) \
                or not isinstance(self.shape[-1], int) \
                or self.shape[-1] > PERSISTENT_ROW_MAX_COLS \
                or take_dim(t, rank) == rank - 1 or index.meta.shape[-1] != 1 \
                or aligned_shape(x, rank)[-1] != self.shape[-1]:
            return False
        self.dim = rank - 1
        self.loaded.update(t.args)
        return True

    def _along_rows(self, t: Term) -> bool:
        """An iota of the space's rank whose one long dim is the rows' (it fixes the
        row dim if nothing has): each element's column index."""
        rank, d = len(self.shape), t.attr("dim")
        if t.meta.rank != rank or not whole(d) or not -rank <= d < rank:
            return False
        d %= rank
        if self.dim is None:
            self.dim = d
        return d == self.dim and tuple(t.meta.shape) == tuple(
            s if k == d else 1 for k, s in enumerate(self.shape))

    def can_output(self, t: Term) -> bool:
        """A float of the rows' shape or one per row (before a reduction fixes the row
        dim, one size-1 dim), never one that broadcasts to the rows otherwise."""
        shape = tuple(t.meta.shape)
        if t.meta.dtype not in FLOATS:
            return False
        if shape == self.shape or self.dim is not None:
            return shape in (self.shape, self.per_row())
        return self._row_dim(shape) is not None

    def _row_dim(self, shape: tuple[Any, ...]) -> int | None:
        """The dim along which `shape` is one value per row of the space (the space's
        shape with that one dim of size 1), or None."""
        if len(shape) != len(self.shape):
            return None
        ones = [k for k, (a, b) in enumerate(zip(shape, self.shape, strict=True)) if a != b]
        return ones[0] if len(ones) == 1 and shape[ones[0]] == 1 else None


def _spec(term: Term, index: int) -> KernelSpec:
    # rows along the dim of the group's first reduction, of its operand's shape
    first = next(t for t in body_terms(term) if t.op in ROW_REDUCTIONS)
    dim = reduced_dim(first)
    assert dim is not None, "RowSpace takes reductions along one dim only"
    spec = spec_of(term, index, "row", rows=(dim, tuple(first.args[0].meta.shape)))
    spec.meta["cols"] = _static(spec)
    return spec


def _static(spec: KernelSpec) -> int:
    """The row length known at compile time (1 when it is symbolic)."""
    try:
        return int(spec.meta["shape"][spec.meta["dim"]])
    except (TypeError, KeyError, IndexError):
        return 1


def _variant(spec: KernelSpec, target: str) -> str | None:
    if target != "triton":
        return None
    if looped(spec):
        return "row_looped"
    return "row_multi" if narrow(spec) else None


# Widest row (static columns) a Triton program takes several of (kinds/row_multi.py):
# one row of a few dozen values a program leaves most of its lanes idle, and even at
# 768 columns two rows a program ran faster (H200, bf16 layer_norm of 8192x768:
# 7.1 against 7.8 us; runtime/launch.py: MULTI_ROW_VALUES).
MULTI_ROW_MAX_COLS = 1024


def narrow(spec: KernelSpec) -> bool:
    """Whether a Triton row kernel's rows are narrow enough to take several a
    program: a static width of at most MULTI_ROW_MAX_COLS."""
    cols = static_width(spec)
    return cols is not None and cols <= MULTI_ROW_MAX_COLS


# Row width up to which a Triton row's amax/amin is one NaN-propagating tl.reduce:
# on an H200, GPT-2's masked attention softmax (1024 fp16 columns) ran 0.147 ms
# that way against 0.166 ms with tl.max plus a NaN count; at 32K f32 columns the
# second form was faster (softmax 0.075 against 0.097 ms).
NAN_COMBINE_MAX_COLS = 4096


def render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
           table: OpTable) -> str:
    check_template(spec, target)
    if target == "triton":
        return render_triton(spec, table)
    return _CppRow(spec, table).render(simd_decls)


# ------------------------------------------------------------------------- Triton
@dataclass(frozen=True)
class TritonRows:
    """How a Triton row template lays its rows out: one row a program (`row`, 1-d
    values, per-row values scalars) or ROWS rows a program (`row_multi`, 2-d values
    [ROWS, BLOCK_C], per-row values [ROWS, 1], rows past the last masked)."""

    axis: int = 0  # the axis a reduction along the row reduces
    row_mask: str | None = None  # the mask of a per-row load or store

    def keep(self) -> str:
        """A reduction's last arguments: its result keeps the reduced axis, of size 1,
        where values are 2-d."""
        return ", keep_dims=True" if self.axis else ""


ONE_ROW = TritonRows()


def render_triton(spec: KernelSpec, table: OpTable, rows: TritonRows = ONE_ROW,
                  **extra: Any) -> str:
    """The Triton source of a row kernel whose template lays rows out as `rows`
    says; `extra`: more template variables."""
    names = term_names(spec)
    tables = _tables(spec)
    loads = [_triton_load(spec, k, inp, rows) for k, inp in enumerate(spec.inputs)
             if k not in tables]
    stmts: list[str] = []
    for t in spec.body:
        if t.op in ROW_REDUCTIONS:
            stmts += _triton_reduce(spec, t, names, rows)
        elif t.op == "take":
            stmts += _triton_take(spec, t, names)
        elif t.op not in ("arg", "const"):
            stmts.append(triton_statement(t, names, table))
    stores = [triton_store(spec, o, names[t], "row", rows.row_mask) if o.per_row else
              triton_store(spec, o, names[t], "row * n_cols + cols", "mask")
              for o, t in zip(spec.outputs, spec.written, strict=True)]
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"), name=spec.symbol,
                           params=triton_params(spec, row_width_param(spec)), loads=loads,
                           stmts=stmts, stores=stores, **extra)


def _tables(spec: KernelSpec) -> set[int]:
    """The inputs only takes read (their tables): rows an index names, not the row's."""
    read = {a.attr("index") for t in spec.body if t.op != "take" for a in t.args
            if a.op == "arg"}
    return {t.args[0].attr("index") for t in spec.body if t.op == "take"} - read


def _triton_take(spec: KernelSpec, t: Term, names: dict[Term, str]) -> list[str]:
    """A take's element: the table's row the per-row index names, masked and asserted
    inside the table (kinds/indexed.py does the same for pointwise kernels)."""
    x, index = t.args
    rank, k = spec.rank, x.attr("index")
    inp, at = spec.inputs[k], names[index]
    j = take_dim(t, rank)
    n = aligned_shape(x, rank)[j]
    inside = f"({at} >= 0) & ({at} < {n})"
    # the row read is clamped into the table (the assert reports an index outside it)
    row = f"tl.where({inside}, {at}, 0) * {inp.name}_stride{j} + " if n != 1 else ""
    return [triton_take_assert(inside),
            triton_load(spec, k, f"{row}cols * {inp.name}_stride{rank - 1}", "mask",
                        names[t])]


def _triton_load(spec: KernelSpec, k: int, inp: KInput, rows: TritonRows) -> str:
    if inp.flat:
        return triton_load(spec, k, "row", rows.row_mask) if inp.per_row else \
            triton_load(spec, k, "row * n_cols + cols", "mask")
    row = print_index(strided_offset(spec.rank, inp.name, "row", skip_last=True), "triton")
    if inp.per_row:
        return triton_load(spec, k, row, rows.row_mask)
    return triton_load(spec, k, f"{row} + cols * {inp.name}_stride{spec.rank - 1}", "mask")


def _triton_reduce(spec: KernelSpec, t: Term, names: dict[Term, str],
                   rows: TritonRows) -> list[str]:
    """The lines reducing `t`'s operand along the row into names[t]."""
    src, axis, keep = names[t.args[0]], rows.axis, rows.keep()
    if t.op in ("sum", "mean"):
        e = f"tl.sum(tl.where(mask, {src}, 0.0), axis={axis}{keep})"
        return [f"{names[t]} = {e} / n_cols" if t.op == "mean" else f"{names[t]} = {e}"]
    fill = "float('-inf')" if t.op == "amax" else "float('inf')"
    # tl.max drops nan; torch.amax returns nan for a row that has one.
    if int(spec.meta.get("cols") or 0) <= NAN_COMBINE_MAX_COLS:
        # one reduction whose combine function propagates nan
        fn = "_max_propagate_nan" if t.op == "amax" else "_min_propagate_nan"
        return [f"{names[t]} = tl.reduce(tl.where(mask, {src}, {fill}), {axis}, {fn}{keep})"]
    # wide rows: tl.max plus a count of nans is faster there
    fn = "tl.max" if t.op == "amax" else "tl.min"
    return [f"{names[t]}_nan = tl.sum(tl.where(mask & ({src} != {src}), 1, 0), "
            f"axis={axis}{keep}) > 0",
            f"{names[t]} = tl.where({names[t]}_nan, float('nan'), "
            f"{fn}(tl.where(mask, {src}, {fill}), axis={axis}{keep}))"]


# ------------------------------------------------------------------------- OpenMP
@dataclass
class _CppRow:
    """A row kernel for templates/openmp/row.cpp.j2: per-row values first (loads,
    then reductions in order, each a loop over the row that recomputes only the
    element values it needs), then the output loop. A step is a per-row line or a
    reduction, whose loop the template writes."""

    spec: KernelSpec
    table: OpTable
    names: dict[Term, str] = field(init=False)
    ctype: str = field(init=False)
    done: set[Term] = field(init=False)  # per-row values computed by earlier steps
    stored: dict[Term, str] = field(default_factory=dict)  # read back from this pointer
    kept: Term | None = None  # stored in the output by the last reduction's loop

    def __post_init__(self) -> None:
        self.names = term_names(self.spec)
        self.ctype = CPP_DTYPES[self.spec.compute]
        self.done = {t for t in self.spec.body if t.op == "arg" and per_row(t, self.spec)}

    def take(self, t: Term) -> str:
        """A take's element: its table's row the per-row index names, at column c."""
        x, index = t.args
        rank, spec = self.spec.rank, self.spec
        inp = spec.inputs[x.attr("index")]
        j = take_dim(t, rank)
        sizes = aligned_shape(x, rank)
        off = " + ".join([f"{self.names[index]} * {inp.name}_stride{j}"] * (sizes[j] != 1)
                         + [f"c * {inp.name}_stride{rank - 1}"])
        return f"const {cpp_value_type(t.meta.dtype, self.ctype)} {self.names[t]} = " \
            f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};"

    def load(self, inp: KInput, idx: int) -> str:
        spec = self.spec
        if inp.per_row:
            off = "r" if inp.flat else print_index(
                strided_offset(spec.rank, inp.name, "r", skip_last=True), "cpp")
        else:
            off = "r * n_cols + c" if inp.flat else (
                f"{print_index(strided_offset(spec.rank, inp.name, 'r', True), 'cpp')} "
                f"+ c * {inp.name}_stride{spec.rank - 1}")
        return f"const {cpp_value_type(inp.dtype, self.ctype)} x{idx} = " \
            f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};"

    def needed(self, targets: list[Term], known: frozenset[Term] = frozenset()) -> list[Term]:
        """Element terms the targets need, in body order, not going past `known`."""
        reach: set[Term] = set()
        stack = list(targets)
        while stack:
            u = stack.pop()
            if u not in reach:
                reach.add(u)
                if u not in known:
                    # a take's table is read by the take itself, not loaded at (r, c)
                    stack.extend(u.args[1:] if u.op == "take" else u.args)
        return [t for t in self.spec.body if t in reach and t not in known and t.op != "const"
                and t not in self.done and not per_row(t, self.spec)]

    def elem_lines(self, targets: list[Term]) -> tuple[list[str], list[Term]]:
        """The lines computing the targets' element values (stored ones read back,
        first), and the terms they compute."""
        terms = self.needed(targets, frozenset(self.stored))
        reach = {a for t in [*targets, *terms] for a in (t, *t.args)}
        out = [f"const {cpp_value_type(t.meta.dtype, self.ctype)} {self.names[t]} = "
               f"{self.stored[t]}[r * n_cols + c];"
               for t in self.spec.body if t in self.stored and (t in reach or t is self.kept)]
        for t in terms:
            if t.op == "arg":
                out.append(self.load(self.spec.inputs[t.attr("index")], t.attr("index")))
            elif t.op == "take":
                out.append(self.take(t))
            else:
                out.append(cpp_statement(t, self.names, self.ctype, self.table))
        return out, terms

    def choose_kept(self, elements: list[Term], reductions: list[Term]) -> None:
        """The output loop would recompute what the last reduction's loop computed
        (the exp of a softmax): that loop stores the latest such value in the output,
        and the output loop reads it back (softmax 1024x1024: 0.49 -> 0.38 ms on 2
        cores)."""
        spec = self.spec
        if reductions and not spec.per_row_out and spec.out_dtype == spec.compute:
            for_output = set(self.needed(elements))
            shared = [t for t in self.needed([reductions[-1].args[0]])
                      if t in for_output and t.op != "arg"]
            self.kept = shared[-1] if shared else None

    def steps(self, reductions: list[Term], side: dict[Term, str]) -> list[dict[str, Any]]:
        """The per-row steps: per-row loads, then each reduction's loop or per-row line."""
        spec, names = self.spec, self.names
        steps: list[dict[str, Any]] = [{"reduce": False, "line": self.load(inp, k)}
                                       for k, inp in enumerate(spec.inputs) if inp.per_row]
        for t in spec.body:
            if t.op in ("arg", "const") or t in self.done:
                continue
            if t.op in ROW_REDUCTIONS:
                steps.append(self.reduce_step(t, t is reductions[-1], side))
                self.done.add(t)
            elif per_row(t, spec):
                steps.append({"reduce": False,
                              "line": cpp_statement(t, names, self.ctype, self.table)})
                self.done.add(t)
        return steps

    def reduce_step(self, t: Term, last: bool, side: dict[Term, str]) -> dict[str, Any]:
        names = self.names
        acc = cpp_accumulator(t.op, f"{names[t]}_acc", self.ctype)
        lines, terms = self.elem_lines([t.args[0]])
        # An S-shaped side output is stored by the first loop that computes it; later
        # loops read it back instead of computing it again (the row is one thread's).
        new = [u for u in terms if u in side and u not in self.stored]
        self.stored.update((u, side[u]) for u in new)
        body = lines + acc.update(names[t.args[0]]) + \
            [f"{side[u]}[r * n_cols + c] = {names[u]};" for u in new]
        if self.kept is not None and last:
            body.append(f"out_ptr[r * n_cols + c] = {names[self.kept]};  // read back below")
        return {"reduce": True, "pairwise": acc.pairwise, "declare": acc.declare(),
                "thread_init": acc.thread_init(), "chunk_init": acc.chunk_init(),
                "clauses": acc.clauses(), "body": body, "chunk_end": acc.chunk_end(),
                "thread_end": acc.thread_end(), "single_end": acc.single_end(),
                "finish": acc.finish(names[t], "n_cols" if t.op == "mean" else None)}

    def render(self, simd_decls: tuple[str, ...]) -> str:
        spec, names = self.spec, self.names
        reductions = [t for t in spec.body if t.op in ROW_REDUCTIONS]
        written = list(zip(spec.outputs, spec.written, strict=True))
        elements = [t for o, t in written if not o.per_row]  # S-shaped outputs
        self.choose_kept(elements, reductions)
        # (Not a side output narrower than the compute dtype: read back, it would differ.)
        side = {t: f"{o.name}_ptr" for o, t in written[1:]
                if not o.per_row and o.dtype == spec.compute}
        steps = self.steps(reductions, side)
        if self.kept is not None:
            self.stored[self.kept] = "out_ptr"
        finals = [t for t in elements if t not in self.stored]  # what the output loop stores
        out_lines = self.elem_lines(finals)[0] if finals else []
        row_stores = [{"ptr": f"{o.name}_ptr", "value": cpp_write(o.dtype, names[t])}
                      for o, t in written if o.per_row]
        elem_stores = [{"ptr": f"{o.name}_ptr", "value": cpp_write(o.dtype, names[t])}
                       for o, t in written if t in finals]
        return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                               header=kernel_header(spec, "openmp", "//"),
                               name=spec.symbol, params=cpp_params(spec, "n_rows"),
                               row_steps=steps, chunk=PAIRWISE_CHUNK, elem_body=out_lines,
                               row_stores=row_stores, elem_stores=elem_stores,
                               simd_decls=simd_decls)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"header", "loads", "name", "params", "stmts", "stores"}),
    "openmp": frozenset({"chunk", "elem_body", "elem_stores", "header", "name", "params",
                         "row_steps", "row_stores", "simd_decls"}),
}


KIND = Kind(name="row", template_variables=TEMPLATE_VARIABLES,
            doc="pointwise work around reductions along one dim, a row per program",
            space=RowSpace, spec=_spec, variant=_variant, render=render,
            launchers={"triton": "RowTritonLauncher", "openmp": "CppLauncher"},
            tuning=RowTuning())
