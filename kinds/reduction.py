"""The `reduction` template: sum/mean/amax/amin over any set of dims, with the
pointwise work before it (the prologue: one value per input element) and after
it (the epilogue: one value per output element) in the same kernel.

The launcher (runtime/launch.py) permutes the input space I so that the kept
dims come first and the reduced dims last (`size0`, `size1`, ...). An output
index `o` runs over the kept dims and a reduction index `r` over the reduced
dims, both row-major; an input read by the prologue sits at offset(o) +
offset(r), one read by the epilogue at offset(o) over the output's dims. The
offsets are built with sympy as in kinds/kernels.py.

- Triton: a program reduces BLOCK_O outputs, accumulating [BLOCK_O, BLOCK_R]
  tiles over its slice of `r`. With few outputs and a long reduction (a full
  reduction, a bias gradient) the launcher splits `r` over a second grid
  axis: each program stores its partial results and `NAME_combine` reduces
  them and runs the epilogue.
- OpenMP: the threads share the outputs when there are enough of them, else
  they share each output's reduction, each taking whole chunks of it. Sums are
  taken pairwise in chunks (kinds/accumulators.py), as accurate as ATen's.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sympy

from ..engine.fuse import (
    FLOATS,
    INTS,
    ROW_REDUCTIONS,
    body_terms,
    broadcasts,
    counts,
    kernel_outputs,
    kernel_value,
    reduced_dims,
)
from ..engine.ops import OpTable, default_op_table
from ..engine.term import Term
from .accumulators import COLUMN_CHUNK, PAIRWISE_CHUNK, CppAccumulator, cpp_accumulator
from .kernels import (
    CPP_DTYPES,
    FILLS,
    TRITON_DTYPES,
    _contiguous,
    _key,
    cpp_read,
    cpp_statement,
    cpp_value_type,
    cpp_write,
    kernel_header,
    load_cast,
    print_index,
    term_names,
    value_expr,
)
from .kind import Kind
from .spec import KernelSpec, KInput, KOutput, stride_params
from .templates import render_template
from .tuning import ReductionTuning

# OpenMP: below this many elements, an output's reduction is not worth a
# parallel region (its start costs a few microseconds).
PARALLEL_REDUCTION_MIN = 32768


def in_prologue(shape: tuple[Any, ...], in_shape: tuple[Any, ...] | None,
                out_shape: tuple[Any, ...]) -> bool:
    """Is a (non-reduction) member of this shape computed per reduced element (the
    prologue)? One of the input's shape, or one that broadcasts to it but is not of
    the output's shape (a per-channel shift the prologue subtracts): computed where
    it is read, from inputs read through the broadcast. Of the output's shape, it is
    the epilogue's."""
    if in_shape is None:
        return False
    return shape == in_shape or (shape != out_shape and broadcasts(shape, in_shape))


def member_phases(body: list[Term], written: list[Term], in_shape: tuple[Any, ...],
                  out_shape: tuple[Any, ...]) -> dict[Term, set[str]]:
    """Which phases compute each member: "in" (the prologue, per reduced element) where
    a reduction's operand needs it, "out" (the epilogue, per output) where an output
    or the epilogue does; reductions are "in". A value that broadcasts to both spaces
    (a 0-d one) may be needed by both, and is computed in each from inputs read
    through the broadcast: by shape alone (`in_prologue`) it was the prologue's, which
    an epilogue reading it then missed (a bf16 amax's gradient, found by the fuzzer).
    A member neither phase reaches keeps its phase by shape."""
    phases: dict[Term, set[str]] = {t: set() for t in body}

    def mark(t: Term, phase: str) -> None:
        stack = [t]
        while stack:
            u = stack.pop()
            if u.op in ("arg", "const") or phase in phases.setdefault(u, set()):
                continue
            if phase == "out" and u.op in ROW_REDUCTIONS:
                continue  # the epilogue reads its result; the prologue computes it
            phases[u].add(phase)
            stack.extend(u.args)

    for t in written:
        mark(t, "out")
    for t in body:
        if t.op in ROW_REDUCTIONS:
            mark(t, "in")
    for t in body:
        if t.op not in ("arg", "const") and not phases[t]:
            phases[t].add("in" if in_prologue(tuple(t.meta.shape), in_shape, out_shape)
                          else "out")
    return phases


def reduction_spec(term: Term, index: int) -> KernelSpec:
    """The KernelSpec of a `reduction` kernel term; `meta` says which dims are
    reduced and, per input, which phase reads it and whether it is read flat."""
    body = body_terms(term)
    root = term.attr("body")
    reductions = [t for t in body if t.op in ROW_REDUCTIONS]
    first = reductions[0]
    dims = reduced_dims(first)
    if dims is None:
        raise ValueError(f"{first.op} is not a reduction the template renders")
    in_shape = tuple(first.args[0].meta.shape)
    out_shape = tuple(first.meta.shape)
    rank = len(in_shape)
    kept = [d for d in range(rank) if d not in dims]
    phases: dict[int, set[str]] = {i: set() for i in range(len(term.args))}
    written = list(kernel_outputs(term))
    for t, member in member_phases(body, written, in_shape, out_shape).items():
        for a in t.args:
            if a.op == "arg":
                phases[a.attr("index")].update(member)
    trailing = tuple(dims) == tuple(range(len(kept), rank))
    inputs, in_flat, out_flat = [], [], []
    for i, a in enumerate(term.args):
        contiguous = a.meta.rank > 0 and _contiguous(a)
        # read flat by the prologue: offset o * n_red + r (the reduced dims are innermost)
        in_flat.append(trailing and contiguous and tuple(a.meta.shape) == in_shape)
        out_flat.append(contiguous and tuple(a.meta.shape) == out_shape)
        flat = all(in_flat[i] if p == "in" else out_flat[i] for p in phases[i])
        inputs.append(KInput(f"in{i}", a.meta.dtype, flat, False, rank))
    ops = [t for t in body if t.op not in ("arg", "const")]
    digest = hashlib.sha256(repr((term.attr("rule"), [_key(t) for t in body],
                                  [body.index(t) for t in written], rank, dims,
                                  first.attr("keepdim"), [sorted(p) for p in phases.values()],
                                  in_flat, out_flat, [x.dtype for x in inputs])).encode())
    name = f"k{index}_{term.attr('rule').replace('-', '_')}_{digest.hexdigest()[:8]}"
    return KernelSpec(name=name, kind="reduction", rule=term.attr("rule"),
                      location=term.attr("location"), template=term.attr("kind"),
                      template_dir=term.attr("template_dir"),
                      inputs=inputs, body=body, root=root, written=written,
                      outputs=[KOutput("out" if k == 0 else f"out{k}", t.meta.dtype, False,
                                       out_shape) for k, t in enumerate(written)],
                      rank=rank, replaced_ops=len(ops),
                      meta={"dims": dims, "kept": kept, "in_shape": in_shape,
                            "out_shape": out_shape, "keepdim": first.attr("keepdim"),
                            "phases": [sorted(phases[i]) for i in range(len(inputs))],
                            "in_flat": in_flat, "out_flat": out_flat,
                            "accumulators": len(reductions)})


def linear_offset(index: str, positions: list[int], stride: str) -> sympy.Expr:
    """sum_k ((index // prod(size[later positions])) % size[p_k]) * {stride}{p_k}: the
    offset of a row-major index over the space's dims at `positions`."""
    idx = sympy.Symbol(index, integer=True, nonnegative=True)
    sizes = {p: sympy.Symbol(f"size{p}", integer=True, positive=True) for p in positions}
    expr = sympy.Integer(0)
    for k, p in enumerate(positions):
        last = k == len(positions) - 1
        q = idx if last else sympy.floor(idx / sympy.Mul(*[sizes[x] for x in positions[k + 1:]]))
        pos = q if k == 0 else sympy.Mod(q, sizes[p])
        expr += pos * sympy.Symbol(f"{stride}{p}", integer=True)
    return expr


def _offsets(spec: KernelSpec, i: int, phase: str, o: str, r: str, target: str) -> str:
    """Where input i sits, for the prologue (`in`, output index `o` plus reduction
    index `r`) or the epilogue (`out`, output index `o`)."""
    inp = spec.inputs[i]
    kept = list(range(len(spec.meta["kept"])))
    if phase == "in":
        if spec.meta["in_flat"][i]:
            return f"{o} * n_red + {r}"
        expr = _strided_in(spec, i, o, r)
    else:
        if spec.meta["out_flat"][i]:
            return o
        expr = linear_offset(o, kept, f"{inp.name}_out_stride")
    text = print_index(expr, target) if expr != 0 else "0"
    index = sympy.Symbol(o, integer=True, nonnegative=True)
    if target == "triton" and index not in expr.free_symbols:
        # the zero term gives the pointer the block's shape, as the mask has
        text = f"{text} + {o} * 0"
    return text


def _split(spec: KernelSpec) -> tuple[list[Term], list[Term], list[Term]]:
    """(prologue, reductions, epilogue) terms in body order (`member_phases`: a value
    both phases need is in both lists)."""
    phases = member_phases(spec.body, spec.written, spec.meta["in_shape"],
                           spec.meta["out_shape"])
    pro, red, epi = [], [], []
    for t in spec.body:
        if t.op in ("arg", "const"):
            continue
        if t.op in ROW_REDUCTIONS:
            red.append(t)
            continue
        if "in" in phases[t]:
            pro.append(t)
        if "out" in phases[t]:
            epi.append(t)
    return pro, red, epi


def render_reduction(spec: KernelSpec, target: str, table: OpTable | None = None,
                     simd_decls: tuple[str, ...] = ()) -> str:
    table = table or default_op_table()
    if target == "triton":
        return _render_triton(spec, table)
    return _render_cpp(spec, table, simd_decls)


# ------------------------------------------------------------------ accumulators
FILL = {"sum": "0.0", "mean": "0.0", "amax": "float('-inf')", "amin": "float('inf')"}

# Triton accumulators are blocks: each lane adds one value per pass of the loop, and
# a lane's sum over many passes (a long row, a full reduction split over few
# programs) would lose accuracy with their number. Sums are Kahan-compensated: a
# second block `{acc}_c` holds each lane's rounding error, so a lane's error stays
# a few ulps whatever the number of passes, and the lanes' final tl.sum is a tree.
# (The OpenMP kernels sum pairwise instead: kinds/accumulators.py.) A lane that
# reaches inf or nan keeps no compensation, which would be nan.


def triton_init(op: str, acc: str, shape: str, dtype: str) -> list[str]:
    """An accumulator block of `shape` (e.g. "[BLOCK_C]"), and a sum's compensation."""
    lines = [f"{acc} = tl.full({shape}, {FILL[op]}, {dtype})"]
    if op in ("sum", "mean"):
        lines.append(f"{acc}_c = tl.zeros({shape}, {dtype})")
    return lines


def triton_accumulate(op: str, acc: str, value: str, mask: str | None) -> list[str]:
    """acc <- acc (+) value for the masked-in lanes; max/min keep nan (torch.amax does)."""
    masked = f"tl.where({mask}, {value}, {FILL[op]})" if mask else value
    if op in ("sum", "mean"):
        return [f"{acc}_y = {masked} - {acc}_c",
                f"{acc}_t = {acc} + {acc}_y",
                f"{acc}_c = tl.where(tl.abs({acc}_t) < float('inf'), "
                f"({acc}_t - {acc}) - {acc}_y, 0.0)",
                f"{acc} = {acc}_t"]
    fn = "tl.maximum" if op == "amax" else "tl.minimum"
    return [f"{acc} = {fn}({acc}, {masked}, propagate_nan=tl.PropagateNan.ALL)"]


def triton_finish(op: str, name: str, acc: str, axis: int) -> str:
    """The reduced value of an accumulator block (mean's division is not included)."""
    if op in ("sum", "mean"):
        return f"{name} = tl.sum({acc} - {acc}_c, axis={axis})"
    fn = "tl.max" if op == "amax" else "tl.min"
    # tl.max / tl.min may drop nan on the GPU; a lane that saw one holds nan
    return (f"{name} = tl.where(tl.sum(({acc} != {acc}).to(tl.int32), axis={axis}) > 0, "
            f"float('nan'), {fn}({acc}, axis={axis}))")


# ------------------------------------------------------------------ Triton
def _render_triton(spec: KernelSpec, table: OpTable) -> str:
    names = term_names(spec)
    compute = TRITON_DTYPES[spec.compute]
    pro, red, epi = _split(spec)
    loads, epi_loads = [], []
    for i, inp in enumerate(spec.inputs):
        phases = spec.meta["phases"][i]
        cast = load_cast(inp.dtype, compute)
        if "in" in phases:
            off = _offsets(spec, i, "in", "out_idx", "red_idx", "triton")
            loads.append(f"x{i} = tl.load({inp.name}_ptr + {off}, mask=mask, other=0){cast}")
        if "out" in phases:
            off = _offsets(spec, i, "out", "offs_o", "", "triton")
            epi_loads.append(f"x{i} = tl.load({inp.name}_ptr + {off}, mask=mask_o, other=0){cast}")
    stmts = [f"{names[t]} = {value_expr(t, names, 'triton', table)}" for t in pro]
    init, update, finish, partial, combine = [], [], [], [], []
    for j, t in enumerate(red):
        acc = f"acc{j}"
        init += triton_init(t.op, acc, "[BLOCK_O, BLOCK_R]", compute)
        update += triton_accumulate(t.op, acc, names[t.args[0]], "mask")
        finish.append(triton_finish(t.op, names[t], acc, 1))
        partial.append(f"tl.store(part_ptr + ({j} * n_split + pid_r) * n_out + offs_o, "
                       f"{names[t]}, mask=mask_o)")
        combine += triton_init(t.op, acc, "[BLOCK_O, BLOCK_S]", compute)
    combine_loads = [line for j, t in enumerate(red) for line in triton_accumulate(
        t.op, f"acc{j}", f"tl.load(part_ptr + ({j} * n_split + offs_s[None, :]) * n_out "
        f"+ offs_o[:, None], mask=mask, other={FILL[t.op]})", None)]
    combine_finish = [triton_finish(t.op, names[t], f"acc{j}", 1) for j, t in enumerate(red)]
    means = [f"{names[t]} = {names[t]} / n_red" for t in red if t.op == "mean"]
    epilogue = epi_loads + [f"{names[t]} = {value_expr(t, names, 'triton', table)}" for t in epi]
    params = [f"{i.name}_ptr" for i in spec.inputs] + [f"{o.name}_ptr" for o in spec.outputs]
    params += [f"size{k}" for k in range(spec.rank)] + stride_params(spec)
    params += ["n_out", "n_red"]
    stores = [f"tl.store({o.name}_ptr + offs_o, {names[t]}.to({TRITON_DTYPES[o.dtype]}), "
              "mask=mask_o)" for o, t in zip(spec.outputs, spec.written, strict=True)]
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"),
                           name=spec.symbol, params=params, init=init, loads=loads, stmts=stmts,
                           update=update, finish=finish, partial=partial, means=means,
                           combine_init=combine, combine_loads=combine_loads,
                           combine_finish=combine_finish, epilogue=epilogue, stores=stores,
                           result=names[spec.root], out_dtype=TRITON_DTYPES[spec.out_dtype])


# ------------------------------------------------------------------ OpenMP
def _render_cpp(spec: KernelSpec, table: OpTable, simd_decls: tuple[str, ...]) -> str:
    names = term_names(spec)
    ctype = CPP_DTYPES[spec.compute]
    pro, red, epi = _split(spec)
    params = [f"const {CPP_DTYPES[i.dtype]}* __restrict__ {i.name}_ptr" for i in spec.inputs]
    params += [f"{CPP_DTYPES[o.dtype]}* __restrict__ {o.name}_ptr" for o in spec.outputs]
    params += [f"int64_t size{k}" for k in range(spec.rank)]
    params += [f"int64_t {p}" for p in stride_params(spec)]
    params += ["int64_t n_out", "int64_t n_red"]
    loads, epi_loads = [], []
    for i, inp in enumerate(spec.inputs):
        phases = spec.meta["phases"][i]
        if "in" in phases:
            off = _offsets(spec, i, "in", "o", "r", "cpp")
            loads.append(f"const {cpp_value_type(inp.dtype, ctype)} x{i} = "
                         f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};")
        if "out" in phases:
            off = _offsets(spec, i, "out", "o", "", "cpp")
            epi_loads.append(f"const {cpp_value_type(inp.dtype, ctype)} x{i} = "
                             f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};")
    body = loads + [cpp_statement(t, names, ctype, table) for t in pro]
    accs = [cpp_accumulator(t.op, f"{names[t]}_acc", ctype) for t in red]
    update = [line for a, t in zip(accs, red, strict=True) for line in a.update(names[t.args[0]])]
    finish = [line for a, t in zip(accs, red, strict=True)
              for line in a.finish(names[t], "n_red" if t.op == "mean" else None)]
    epilogue = epi_loads + [cpp_statement(t, names, ctype, table) for t in epi]
    columns = _cpp_columns(spec, accs)
    col_loads = []
    if columns:
        for i, inp in enumerate(spec.inputs):
            if "in" in spec.meta["phases"][i]:
                col_loads.append(f"const {cpp_value_type(inp.dtype, ctype)} x{i} = " + cpp_read(
                    inp.dtype, f"{inp.name}_ptr[{_unit_offset(spec, i)}]") + ";")

    runs = _cpp_runs(spec, ctype)

    def each(phase: str) -> list[str]:
        return [line for a in accs for line in getattr(a, phase)()]

    return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                           header=kernel_header(spec, "openmp", "//"),
                           name=spec.symbol, params=params, body=body + update,
                           declare=each("declare"), thread_init=each("thread_init"),
                           chunk_init=each("chunk_init"), chunk_end=each("chunk_end"),
                           thread_end=each("thread_end"), single_end=each("single_end"),
                           chunk=PAIRWISE_CHUNK, pairwise=any(a.pairwise for a in accs),
                           simd=f"#pragma omp simd {' '.join(each('clauses'))}",
                           parallel=(f"#pragma omp parallel {' '.join(each('shared_clauses'))} "
                                     f"if(parallel: n_red >= {PARALLEL_REDUCTION_MIN})"),
                           finish=finish, epilogue=epilogue,
                           result=cpp_write(spec.out_dtype, names[spec.root]),
                           stores=[f"{o.name}_ptr[o] = {cpp_write(o.dtype, names[t])};"
                                   for o, t in zip(spec.outputs, spec.written, strict=True)],
                           columns=columns, col_body=col_loads + body[len(loads):] + update,
                           runs=runs, run_body=(runs["loads"] + body[len(loads):] + update
                                                if runs else []),
                           unit_body=(runs["unit_loads"] + body[len(loads):] + update
                                      if runs else []),
                           col_block=COLUMN_BLOCK, col_chunk=COLUMN_CHUNK,
                           simd_decls=simd_decls)


# The shortest innermost reduced dim read in runs (`_cpp_runs`); shorter ones are read
# element by element, each offset from the reduction index.
RUN_MIN = 16


def _cpp_runs(spec: KernelSpec, ctype: str) -> dict[str, Any] | None:
    """The run loop's parts: the prologue reads its strided inputs a run of the
    innermost reduced dim at a time, each input's offset computed once per run and
    stepped by that dim's stride, where an element-by-element read divides the
    reduction index by the reduced sizes for every element (a batch norm's sums over
    N, H and W: three divisions a value). The launcher merges the reduced dims that
    are contiguous for every input into the innermost (runtime/launch.py:
    `merge_inner`), so H and W are one run. None where no input is read strided."""
    ins = [i for i, inp in enumerate(spec.inputs) if "in" in spec.meta["phases"][i]]
    strided = [i for i in ins if not spec.meta["in_flat"][i]]
    if not strided or len(spec.meta["dims"]) == 0:
        return None
    last = spec.rank - 1
    bases = [f"const int64_t b{i} = {print_index(_strided_in(spec, i, 'o', 'p'), 'cpp')};"
             for i in strided]

    def loads(step: str) -> list[str]:
        """Each prologue input's load, strided ones `step` (with {name}) past the base."""
        out = []
        for i in ins:
            inp = spec.inputs[i]
            off = f"b{i} + " + step.format(name=inp.name) if i in strided else \
                _offsets(spec, i, "in", "o", "r", "cpp")
            out.append(f"const {cpp_value_type(inp.dtype, ctype)} x{i} = "
                       f"{cpp_read(inp.dtype, f'{inp.name}_ptr[{off}]')};")
        return out

    # twice, as the pointwise rows: plain vector loads where every strided input is
    # contiguous along the run, else `(r - p) * stride` (gathers)
    unit = " && ".join(f"{spec.inputs[i].name}_stride{last} == 1" for i in strided)
    return {"check": f"size{last} >= {RUN_MIN}", "size": f"size{last}", "bases": bases,
            "loads": loads(f"(r - p) * {{name}}_stride{last}"), "unit": unit,
            "unit_loads": loads("(r - p)")}


# Outputs a thread reduces together when they lie side by side in memory (a bias
# gradient: the sum over dim 0 of a row-major matrix). Reading the input row by row, a
# vector of outputs at a time, instead of one output's column at a time (a cache line
# per value): sum(0) on 2 cores at 512x1024 0.516 -> 0.037 ms, at 4096x1024
# 12.7 -> 0.199 ms (eager 0.036 and 0.338, Inductor 0.071 and 0.684).
COLUMN_BLOCK = 64


def _cpp_columns(spec: KernelSpec, accs: list[CppAccumulator]) -> dict[str, Any] | None:
    """The column loop's parts, where it can apply: some output dim kept, every input
    of the prologue read strided (a flat one has the reduced dims innermost)."""
    kept = len(spec.meta["kept"])
    ins = [i for i, inp in enumerate(spec.inputs) if "in" in spec.meta["phases"][i]]
    if kept == 0 or not ins or any(spec.meta["in_flat"][i] for i in ins):
        return None
    check = " && ".join(f"{spec.inputs[i].name}_stride{kept - 1} == 1" for i in ins)

    def each(phase: str, *args: int) -> list[str]:
        return [line for a in accs for line in getattr(a, f"column_{phase}")(*args)]

    return {"check": check, "arrays": each("arrays", COLUMN_BLOCK), "fill": each("fill"),
            "chunk_fill": each("chunk_fill"), "take": each("take"), "keep": each("keep"),
            "chunk_end": each("chunk_end"), "totals": each("totals"), "result": each("result")}


def _strided_in(spec: KernelSpec, i: int, o: str, r: str) -> sympy.Expr:
    """Where the prologue reads strided input i: output index `o` over the kept dims
    (first in the space) plus reduction index `r` over the reduced ones."""
    name, kept = spec.inputs[i].name, len(spec.meta["kept"])
    return linear_offset(o, list(range(kept)), f"{name}_stride") + linear_offset(
        r, list(range(kept, spec.rank)), f"{name}_stride")


def _unit_offset(spec: KernelSpec, i: int) -> str:
    """_offsets(spec, i, "in", "o", "r") with the innermost output dim's stride 1: plain
    vector loads along the outputs where the template checked that it is."""
    last = len(spec.meta["kept"]) - 1
    stride = sympy.Symbol(f"{spec.inputs[i].name}_stride{last}", integer=True)
    return print_index(_strided_in(spec, i, "o", "r").subs(stride, 1), "cpp")


class ReductionSpace:
    """sum/mean/amax/amin over any dims of an input shape I, giving output shape O:
    members are I-shaped values and values that broadcast to I but are not O-shaped
    (the prologue, computed per reduced element: `in_prologue`),
    reductions over the same dims of I-shaped values, and O-shaped values (the
    epilogue, on the reduced values). I == O (only size-1 dims reduced, keepdim)
    is refused: the two phases could not be told apart by shape. Side outputs are
    O-shaped values (a reduction's result or an epilogue value something else reads
    too: batch norm's mean, also read by the running mean's update); the prologue's
    values exist only inside the reduction's (possibly split) loop. O-shaped users
    may bring inputs of their own (`user_inputs`: the running mean, a weight), so
    per-channel work on the results runs in the kernel. Groups of one `siblings` key
    (the same I, dims and O) may merge once formed (engine/fuse.py:
    `_merge_siblings`): one kernel, several outputs."""

    side_outputs = True
    user_inputs = True

    def __init__(self, root: Term) -> None:
        self.out_shape = tuple(root.meta.shape)
        self.in_shape: tuple[Any, ...] | None = None
        self.signature: tuple[Any, ...] | None = None  # (I, dims, keepdim)

    def fits(self, t: Term) -> bool:
        if not kernel_value(t) or t.op in FILLS:  # its launcher sizes the space by inputs
            return False
        if t.op in ROW_REDUCTIONS and t.meta.dtype not in FLOATS and not counts(t):
            return False  # integer sums but counts of masks stay with ATen
        shape = tuple(t.meta.shape)
        if t.op in ROW_REDUCTIONS:
            dims = reduced_dims(t)
            if dims is None or shape != self.out_shape:
                return False
            signature = (tuple(t.args[0].meta.shape), dims, t.attr("keepdim"))
            if self.signature is None and signature[0] != shape:
                self.signature, self.in_shape = signature, signature[0]
            return signature == self.signature
        return shape == self.out_shape or in_prologue(shape, self.in_shape, self.out_shape)

    def _prologue(self, t: Term) -> bool:
        return t.op not in ROW_REDUCTIONS and in_prologue(
            tuple(t.meta.shape), self.in_shape, self.out_shape)

    def can_output(self, t: Term) -> bool:
        return t.meta.kind == "tensor" and (t.meta.dtype in FLOATS or t.meta.dtype in INTS) \
            and tuple(t.meta.shape) == self.out_shape

    def admits(self, t: Term, members: set[Term]) -> bool:
        """`accepts`, for one more member: a prologue value reads no reduced one, and
        no prologue member reads `t` if it is reduced (`x * sum(x)` takes two passes)."""
        if self.in_shape is None:
            return True
        if self._prologue(t):
            return all(self._prologue(a) for a in t.args if a in members)
        return not any(t in m.args for m in members if self._prologue(m))

    def siblings(self) -> tuple[Any, ...] | None:
        """What groups that may merge share: the signature and the output shape."""
        return None if self.signature is None else (self.signature, self.out_shape)

    def accepts(self, members: set[Term]) -> bool:
        """One pass: no prologue value may depend on a reduced one (a variance's
        `x - mean(x)` needs two passes over I; fuse-row does that along one dim)."""
        return all(self._prologue(a)
                   for m in members if self._prologue(m)
                   for a in m.args if a in members)


def _render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
            table: OpTable) -> str:
    return render_reduction(spec, target, table, simd_decls=simd_decls)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"combine_finish", "combine_init", "combine_loads", "epilogue",
                         "finish", "header", "init", "loads", "means", "name",
                         "out_dtype", "params", "partial", "result", "stmts", "stores",
                         "update"}),
    "openmp": frozenset({"body", "chunk", "chunk_end", "chunk_init", "col_block",
                         "col_body", "col_chunk", "columns", "declare", "epilogue",
                         "finish", "header", "name", "pairwise", "parallel", "params",
                         "result", "run_body", "runs", "simd", "simd_decls", "single_end",
                         "stores", "thread_end", "thread_init", "unit_body"}),
}


KIND = Kind(name="reduction", template_variables=TEMPLATE_VARIABLES,
            doc="sum/mean/amax/amin over any dims, with prologue and epilogue",
            space=ReductionSpace, spec=reduction_spec, render=_render,
            launchers={"triton": "ReductionTritonLauncher", "openmp": "ReductionCppLauncher"},
            tuning=ReductionTuning())
