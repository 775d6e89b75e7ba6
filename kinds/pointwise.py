"""The `pointwise` kernel kind: one loop over the output's elements.

Rule fuse-pointwise names it. Its spec is built as the row kind's
(kinds/kernels.py: spec_of); its render is here: Python writes the loads,
statements and stores, templates/<target>/pointwise.*.j2 the loop around them.
On Triton, a kernel whose input and output disagree on the innermost dim (NHWC read,
NCHW written) runs as the `pointwise_tiled` variant instead (kinds/pointwise_tiled.py).
A kernel holding indexed ops (cat, slice_scatter, slice_backward, and slices of
values it computes) reads inputs at other positions: kinds/indexed.py writes its
loads and statements, for the same templates.
"""

from __future__ import annotations

from ..engine.fuse import ROW_REDUCTIONS, broadcasts, kernel_value
from ..engine.ops import OpTable, default_op_table
from ..engine.term import Term
from . import indexed
from .kernels import (
    CPP_DTYPES,
    INDEXED_OPS,
    MOVES,
    aligned_shape,
    check_template,
    cpp_value_type,
    cpp_params,
    cpp_read,
    cpp_write,
    cpp_statement,
    kernel_header,
    print_index,
    spec_of,
    strided_offset,
    term_names,
    triton_load,
    triton_params,
    triton_statement,
    triton_store,
)
from .kind import Kind
from .spec import KernelSpec, KInput
from .templates import render_template
from .tuning import PointwiseTuning


class PointwiseSpace:
    """One loop over the output's elements: every member has the root's shape, or
    one that broadcasts to it (a per-channel value, recomputed per element: its
    operands are read through the broadcast, as the kernel's inputs are). A
    member of the root's shape may be a side output (a float, an integer or a bool
    mask): it is stored where the root is, element by element (a broadcast one has
    no such place: it stays outside when something else reads it).
    Indexed ops (kinds/indexed.py) join over a static shape, and so do what they
    read, whatever its shape (a cat's pieces); of the views, only a slice, and only
    once the group holds an indexed op (`indexed`) or of one (a padded tensor's
    shifted part): a kernel without one keeps reading a slice of its input as the
    view it is. A take's operands stay inputs: the kernel reads the index at the
    element and x where it points (`loaded`)."""

    side_outputs = True

    def __init__(self, root: Term) -> None:
        self.shape = tuple(root.meta.shape)
        self.indexed = False
        self.loaded: set[Term] = set()

    def fits(self, t: Term) -> bool:
        if not kernel_value(t) or t.op in ROW_REDUCTIONS or t in self.loaded:
            return False
        if t.op in MOVES or not broadcasts(tuple(t.meta.shape), self.shape):
            # what a cat reads, at other positions: computed values (pointwise, indexed)
            # and slices; no other view (a reshape has no point-for-point reading)
            if t.op not in MOVES and default_op_table().category(t.op) == "view":
                return False
            # a slice of an indexed op (a padded tensor's shifted part) reads it there
            ok = indexed.fits(t, self.shape) and (t.op != "slice" or self.indexed
                                                  or t.args[0].op in INDEXED_OPS)
            self.indexed |= ok and t.op in INDEXED_OPS
            if ok and t.op == "take":
                self.loaded.update(t.args)
            return ok
        return default_op_table().category(t.op) != "view"

    def can_output(self, t: Term) -> bool:
        return kernel_value(t) and tuple(t.meta.shape) == self.shape \
            and t.op != "slice"  # a view: its users read it where it lies


def _spec(term: Term, index: int) -> KernelSpec:
    return spec_of(term, index, "pointwise")


def _variant(spec: KernelSpec, target: str) -> str | None:
    # a layout change: 2-d tiles, so that both sides are read and written contiguously
    return "pointwise_tiled" if target == "triton" and spec.meta.get("tile") is not None \
        else None


def render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
           table: OpTable) -> str:
    check_template(spec, target)
    if target == "triton":
        return _render_triton(spec, table)
    return _render_cpp(spec, table, simd_decls)


def _render_triton(spec: KernelSpec, table: OpTable) -> str:
    if spec.meta.get("indexed"):
        loads, stmts, values = indexed.triton_parts(spec, table)
        return render_elementwise_triton(spec, table, loads, stmts=stmts, values=values)
    loads = [triton_load(spec, k, "offs" if inp.flat else print_index(
        strided_offset(spec.rank, inp.name, "offs"), "triton"), "mask")
        for k, inp in enumerate(spec.inputs)]
    return render_elementwise_triton(spec, table, loads)


def render_elementwise_triton(spec: KernelSpec, table: OpTable, loads: list[str],
                              stmts: list[str] | None = None,
                              values: list[str] | None = None, **extra: object) -> str:
    """The body, stores and template of an elementwise Triton kernel around `loads`:
    every value at `offs` under `mask` (the tiled variant passes its tile's
    offsets in `extra`). `stmts` and the outputs' `values`: one statement per body
    term, unless given (kinds/indexed.py)."""
    if stmts is None or values is None:
        names = term_names(spec)
        stmts = [triton_statement(t, names, table) for t in spec.body
                 if t.op not in ("arg", "const")]
        values = [names[t] for t in spec.written]
    stores = [triton_store(spec, o, v, "offs", "mask")
              for o, v in zip(spec.outputs, values, strict=True)]
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"), name=spec.symbol,
                           params=triton_params(spec, "n_elements"), loads=loads,
                           stmts=stmts, stores=stores, **extra)


def _render_cpp(spec: KernelSpec, table: OpTable, simd_decls: tuple[str, ...]) -> str:
    if spec.meta.get("indexed"):
        return _render_cpp_indexed(spec, table, simd_decls)
    names = term_names(spec)
    ctype = CPP_DTYPES[spec.compute]

    def load(inp: KInput, idx: int) -> str:
        off = "i" if inp.flat else print_index(strided_offset(spec.rank, inp.name, "i"), "cpp")
        return f"const {cpp_value_type(inp.dtype, ctype)} x{idx} = " \
            f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};"

    strided = [inp for inp in spec.inputs if not inp.flat]
    if not strided or spec.rank == 0:
        lines = [load(inp, k) for k, inp in enumerate(spec.inputs)]
        row_lines: list[str] = []
        unit_stride, contiguous = "", []
    else:
        # Rows of the last dim: each strided input's offset is computed once per
        # row (integer division does not vectorize, and a loop with one keeps
        # libmvec's vector exp/erf/... from being used), then `c * stride`.
        row_lines = [f"const int64_t {inp.name}_base = "
                     f"{print_index(strided_offset(spec.rank, inp.name, 'r', True), 'cpp')};"
                     for inp in strided]
        last = spec.rank - 1
        # An input of size 1 along the rows (a per-channel scale over NCHW, the rows
        # being W, or H and W merged: runtime/launch.py) is one value a row: loaded
        # once, before the loop, where `c * stride` would gather it at stride 0.
        constant = _row_constant(spec)
        row_lines += [f"const {cpp_value_type(inp.dtype, ctype)} x{k} = "
                      + cpp_read(inp.dtype, f"{inp.name}_ptr[{inp.name}_base]") + ";"
                      for k, inp in enumerate(spec.inputs) if k in constant]
        # The loop comes twice: with `c * stride` along the row (gathers) and, when
        # every strided input is contiguous along it (a broadcast bias), with plain
        # vector loads: gelu(x + b) at 256x4096 on 2 cores 0.278 -> 0.224 ms.
        unit_stride = " && ".join(f"{inp.name}_stride{last} == 1" for k, inp
                                  in enumerate(spec.inputs)
                                  if not inp.flat and k not in constant) or "true"

        def row_loads(step: str) -> list[str]:
            """Loads at column c, `step` (with {name}) apart in strided inputs."""
            return [f"const {cpp_value_type(inp.dtype, ctype)} x{k} = " + cpp_read(
                inp.dtype, f"{inp.name}_ptr[" + (
                    "i" if inp.flat else f"{inp.name}_base + " + step.format(name=inp.name))
                + "]") + ";" for k, inp in enumerate(spec.inputs) if k not in constant]

        contiguous = row_loads("c")
        lines = row_loads(f"c * {{name}}_stride{last}")
    compute = [cpp_statement(t, names, ctype, table) for t in spec.body
               if t.op not in ("arg", "const")]
    stores = [{"ptr": f"{o.name}_ptr", "value": cpp_write(o.dtype, names[t])}
              for o, t in zip(spec.outputs, spec.written, strict=True)]
    return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                           header=kernel_header(spec, "openmp", "//"), name=spec.symbol,
                           params=cpp_params(spec, "n_elements"), body=lines + compute,
                           stores=stores, rows=bool(row_lines), row_body=row_lines,
                           unit_stride=unit_stride, unit_body=contiguous + compute,
                           simd_decls=simd_decls)


def _row_constant(spec: KernelSpec) -> set[int]:
    """The strided inputs of size 1 along the kernel's rows (its innermost dim in the
    space's order) where the kernel's space is not: stride 0 along every row."""
    order = spec.meta.get("order")
    shape = spec.meta.get("shape")
    if shape is None or spec.rank == 0:
        return set()
    inner = order[-1] if order is not None and len(order) == spec.rank else spec.rank - 1
    if shape[inner] == 1:
        return set()
    args = {t.attr("index"): t for t in spec.body if t.op == "arg"}
    found = set()
    for k, inp in enumerate(spec.inputs):
        a = args.get(k)
        if inp.flat or a is None:
            continue
        ashape = aligned_shape(a, spec.rank)
        if len(ashape) == spec.rank and ashape[inner] == 1:
            found.add(k)
    return found


def _render_cpp_indexed(spec: KernelSpec, table: OpTable, simd_decls: tuple[str, ...]
                        ) -> str:
    """Rows of the last dim, as strided kernels run: the element's index at the outer
    positions and each load's offset there once per row (kinds/indexed.py)."""
    parts = indexed.cpp_parts(spec, table)
    stores = [{"ptr": f"{o.name}_ptr", "value": cpp_write(o.dtype, v)}
              for o, v in zip(spec.outputs, parts.outputs, strict=True)]
    return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                           header=kernel_header(spec, "openmp", "//"), name=spec.symbol,
                           params=cpp_params(spec, "n_elements"), body=parts.body,
                           stores=stores, rows=True, row_body=parts.row_body,
                           unit_stride=parts.unit_stride, unit_body=parts.unit_body,
                           simd_decls=simd_decls)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"header", "loads", "name", "params", "stmts", "stores"}),
    "openmp": frozenset({"body", "header", "name", "params", "row_body", "rows",
                         "simd_decls", "stores", "unit_body", "unit_stride"}),
}


KIND = Kind(name="pointwise", template_variables=TEMPLATE_VARIABLES,
            doc="one loop over the output's elements",
            space=PointwiseSpace, spec=_spec, variant=_variant, render=render,
            launchers={"triton": "TritonLauncher", "openmp": "CppLauncher"},
            tuning=PointwiseTuning())
