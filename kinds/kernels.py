"""From a `kernel` term to kernel source: Python computes every expression,
the templates under `templates/triton/` and `templates/openmp/` lay them out.

A kernel iterates over one space:
- `pointwise`: the output's elements, linear index `i`;
- `row`: rows of length `cols`; values are per element ([R..., C]) or per
  row ([R..., 1], e.g. a reduction's result), reductions run along a row.
Inputs are read either flat (contiguous, same shape as the space: offset is
the linear index) or strided: the offset is the sum of each dim's index times
the input's run-time stride, built and simplified with sympy (broadcast dims
drop out). Sizes and strides are run-time arguments, so one kernel serves
every shape of a dynamic dimension.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from collections.abc import Callable
from typing import Any, Literal

import sympy

from ..engine.fuse import (
    FLOATS,
    MATMULS,
    RESHAPES,
    ROW_REDUCTIONS,
    body_terms,
    kernel_outputs,
    reduced_dim,
)
from ..engine.ops import OpTable, default_op_table
from ..engine.term import Term
from .accumulators import PAIRWISE_CHUNK, cpp_accumulator
from .spec import KernelSpec, KInput, KOutput, size_params, static_width
from .templates import TEMPLATES_DIR, has_template, render_template, template_path

TRITON_DTYPES = {"f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16",
                 "f64": "tl.float64", "b8": "tl.int1"}
CPP_DTYPES = {"f32": "float", "f64": "double", "b8": "bool"}
SAFE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# Row width up to which a Triton row's amax/amin is one NaN-propagating tl.reduce:
# on an H200, GPT-2's masked attention softmax (1024 fp16 columns) ran 0.147 ms
# that way against 0.166 ms with tl.max plus a NaN count; at 32K f32 columns the
# second form was faster (softmax 0.075 against 0.097 ms).
NAN_COMBINE_MAX_COLS = 4096


class RenderError(Exception):
    """The group cannot be rendered by this target; it falls back to ATen."""


def spec_of(term: Term, index: int, kind: Literal["pointwise", "row"]) -> KernelSpec:
    """The spec of a pointwise or row kernel term (kinds/pointwise.py, kinds/row.py)."""
    body = body_terms(term)
    root = term.attr("body")
    dim = None
    if kind == "row":
        dim = next(reduced_dim(t) for t in body if t.op in ROW_REDUCTIONS)
        src = next(t for t in body if t.op in ROW_REDUCTIONS).args[0]
        shape = tuple(src.meta.shape)
    else:
        shape = tuple(root.meta.shape)
    rank = len(shape)
    # Row kernels run along `dim` moved last (the launcher permutes sizes and
    # strides), so inputs are read flat only when `dim` already is last.
    last = dim is None or dim == rank - 1
    per_row_shape = shape[:dim] + (1,) + shape[dim + 1:] if dim is not None else None
    # Pointwise kernels run in the memory order of their output's layout (the
    # strides ATen gives the root, e.g. NHWC after a channels_last convolution):
    # the launcher allocates the output so and permutes sizes and strides to it.
    order = None if kind == "row" else dense_order(root.meta.shape, root.meta.strides)
    inputs = []
    for i, a in enumerate(term.args):
        ashape = (1,) * (rank - a.meta.rank) + tuple(a.meta.shape)
        per_row = dim is not None and ashape[dim] == 1 and shape[dim] != 1
        flat = last and a.meta.rank == rank and _contiguous(a, order) and (
            ashape == shape or (per_row and ashape == per_row_shape))
        shared = dim is not None and not per_row and any(
            shape[k] != 1 for k in range(rank) if k != dim) and all(
            ashape[k] == 1 for k in range(rank) if k != dim)
        inputs.append(KInput(f"in{i}", a.meta.dtype, flat, per_row, rank, shared))
    tile = _tile_dim(term, order, rank) if kind == "pointwise" else None
    ops = [t for t in body if t.op not in ("arg", "const")]
    written = list(kernel_outputs(term))
    outputs = [KOutput("out" if k == 0 else f"out{k}", t.meta.dtype,
                       kind == "row" and tuple(t.meta.shape) != shape, tuple(t.meta.shape))
               for k, t in enumerate(written)]
    key: tuple[Any, ...] = (term.attr("rule"), [_key(t) for t in body], rank, dim, tile,
                            [(x.dtype, x.flat, x.per_row) for x in inputs])
    if len(written) > 1:  # one output keeps the names (and caches) it always had
        key += (tuple(body.index(t) for t in written),)
    digest = hashlib.sha256(repr(key).encode())
    name = f"k{index}_{term.attr('rule').replace('-', '_')}_{digest.hexdigest()[:8]}"
    return KernelSpec(name=name, kind=kind, rule=term.attr("rule"),
                      location=term.attr("location"), template=term.attr("kind"),
                      template_dir=term.attr("template_dir"),
                      inputs=inputs, body=body, root=root, outputs=outputs, written=written,
                      rank=rank, replaced_ops=len(ops),
                      meta={"dim": dim, "shape": shape, "order": order, "tile": tile})


def _tile_dim(term: Term, order: tuple[int, ...] | None, rank: int) -> int | None:
    """For a pointwise kernel with an input whose innermost dim is not the output's
    (a layout change: NHWC read, NCHW written), that dim's position in the kernel's
    space: the Triton kernel then runs in 2-d tiles over it and the space's innermost
    dim, so both sides are accessed contiguously. None: one flat loop serves."""
    space = list(order) if order is not None and len(order) == rank else list(range(rank))
    shape = term.attr("body").meta.shape  # the root's: a kernel of side outputs is a tuple
    if rank < 2 or not isinstance(shape[space[-1]], int) or shape[space[-1]] < 8:
        return None
    for a in term.args:
        if a.meta.kind != "tensor" or a.meta.rank != rank or len(a.meta.strides) != rank:
            continue
        inner = [k for k in range(rank) if a.meta.strides[k] == 1 and a.meta.shape[k] != 1]
        if len(inner) == 1 and inner[0] != space[-1] and isinstance(a.meta.shape[inner[0]], int) \
                and a.meta.shape[inner[0]] >= 8:
            return space.index(inner[0])
    return None


def _key(t: Term) -> Any:
    if t.op == "arg":
        return ("arg", t.attr("index"))
    if t.op == "const":
        return ("const", repr(t.value))
    return (t.op, tuple(k for k, _ in t.attrs), repr([v for _, v in t.attrs]))


def _contiguous(t: Term, order: tuple[int, ...] | None = None) -> bool:
    """Is `t` dense in the dim order `order` (outermost first; None: 0, 1, ...)?"""
    if len(t.meta.strides) != len(t.meta.shape):
        return False
    dims = order if order is not None and len(order) == t.meta.rank else range(t.meta.rank)
    expected: Any = 1
    for k in reversed(list(dims)):
        size, stride = t.meta.shape[k], t.meta.strides[k]
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return True


def dense_order(shape: tuple[Any, ...], strides: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The dims from outermost to innermost in memory when `strides` lay `shape`
    out densely (a permutation of a contiguous tensor: (0, 2, 3, 1) is NHWC),
    else None. Size-1 dims go where they reproduce the given strides, in dim
    order where any place would; sizes may be symbolic (compared as expressions)."""
    if len(strides) != len(shape):
        return None
    left = list(range(len(shape)))
    inner: list[int] = []  # innermost first
    expected: Any = 1
    while left:
        here = [d for d in left if strides[d] == expected]
        ones = sorted((d for d in here if shape[d] == 1), reverse=True)
        big = [d for d in here if shape[d] != 1]
        if len(big) > 1 or not here:
            return None
        inner += ones + big
        left = [d for d in left if d not in here]
        if big:
            expected = expected * shape[big[0]]
    return tuple(reversed(inner))


# ------------------------------------------------------------------ index expressions
def strided_offset(rank: int, name: str, index: str, skip_last: bool = False) -> sympy.Expr:
    """sum_k ((index // prod(size[k+1:])) % size[k]) * stride_k, over the space's dims.

    Sizes are `size{k}`, strides `{name}_stride{k}`; sympy drops the modulo of the
    outermost dim (index < numel) and the division of the innermost."""
    sizes = [sympy.Symbol(f"size{k}", integer=True, positive=True) for k in range(rank)]
    strides = [sympy.Symbol(f"{name}_stride{k}", integer=True) for k in range(rank)]
    return subspace_offset(list(range(rank - 1 if skip_last else rank)), sizes, strides, index)


def subspace_offset(dims: list[int], sizes: list[sympy.Expr], strides: list[sympy.Expr],
                    index: str) -> sympy.Expr:
    """The offset of linear position `index` in the space of `dims` only (outermost
    first): each dim's index, (index // prod(inner sizes)) % size, times its stride."""
    idx = sympy.Symbol(index, integer=True, nonnegative=True)
    expr = sympy.Integer(0)
    for n, k in enumerate(dims):
        inner = sympy.Mul(*[sizes[d] for d in dims[n + 1:]])
        q = sympy.floor(idx / inner) if n < len(dims) - 1 else idx
        pos = q if n == 0 else sympy.Mod(q, sizes[k])
        expr += pos * strides[k]
    return expr


def row_width_param(spec: KernelSpec) -> str:
    """A Triton row kernel's `n_cols` parameter: a compile-time constant when the
    width is static, so that masks of full chunks fold away and a looped kernel's
    trip count is known when it is compiled (H200, 1024 rows of 32K f32 layer_norm:
    0.111 -> 0.083 ms; kinds/row_looped.py). A symbolic width stays a run-time
    argument."""
    return "n_cols" if static_width(spec) is None else "n_cols: tl.constexpr"


def print_index(expr: sympy.Expr, target: str) -> str:
    """Print a non-negative index expression: integer division is `//` in Triton
    and `/` in C++ (int64 operands), remainder is `%` in both."""
    div = "//" if target == "triton" else "/"

    def p(e: sympy.Expr) -> str:
        if isinstance(e, sympy.Symbol):
            return e.name
        if isinstance(e, sympy.Integer):
            return str(int(e))
        if isinstance(e, sympy.Add):
            return " + ".join(p(a) for a in e.args)
        if isinstance(e, sympy.Mul):
            return " * ".join(paren(a) for a in e.args)
        if isinstance(e, sympy.Mod):
            return f"{paren(e.args[0])} % {paren(e.args[1])}"
        if isinstance(e, sympy.floor):
            num, den = sympy.fraction(sympy.together(e.args[0]))
            return f"{paren(num)} {div} {paren(den)}"
        raise RenderError(f"cannot print index expression {e}")

    def paren(e: sympy.Expr) -> str:
        s = p(e)
        return s if isinstance(e, sympy.Symbol | sympy.Integer) else f"({s})"

    return p(expr)


# ------------------------------------------------------------------ value expressions
def literal(value: Any, target: str, single: bool = True) -> str:
    """A constant in kernel source. In C++ float kernels, float literals get an
    `f` suffix so arithmetic stays in single precision as the tensors are."""
    if isinstance(value, bool):
        return ("True" if value else "False") if target == "triton" else str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')" if target == "triton" else "NAN"
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"float('{sign}inf')" if target == "triton" else f"({sign}INFINITY)"
        if target == "triton":
            return repr(value)
        return f"{value!r}f" if single else repr(value)
    raise RenderError(f"no {target} literal for {value!r}")


def value_expr(t: Term, names: dict[Term, str], target: str, table: OpTable) -> str:
    """The expression computing `t` from its operands' names."""
    if t.op == "to":
        # Values live in the compute dtype; a cast to a narrower float rounds.
        x = _operand(t.args[0], names, target, True)
        dtype = t.attr("dtype")
        if t.args[0].meta.dtype == "b8":  # a mask as a number: 0.0 or 1.0
            return f"{x}.to(tl.float32)" if target == "triton" else f"({x} ? 1.0 : 0.0)"
        if dtype in ("f16", "bf16") and target == "triton":
            return f"{x}.to({TRITON_DTYPES[dtype]}).to(tl.float32)"
        return x
    info = table.get(t.op)
    fmt = getattr(info, target if target == "triton" else "cpp", None) if info else None
    if info is None or fmt is None:
        raise RenderError(f"op {t.op} has no {target} expression in rules/ops.yaml")
    single = t.meta.dtype != "f64"
    values = {n: _operand(a, names, target, single) for n, a in
              zip(info.args, t.args, strict=True)}
    for k, v in t.attrs:
        if k in info.attrs and k not in values and k not in info.kernel_when \
                and "{" + k + "}" in fmt:
            values[k] = literal(v, target, single) if v is not None else "None"
    expr = fmt.format(**values)
    if target == "cpp":
        for call, (f32, f64) in PLAIN_CALLS.items():
            expr = expr.replace(call + "(", (f32 if single else f64) + "(")
    return "(" + expr + ")"


# C++ calls spelled by name, not through <cmath>'s overloads (which are GCC
# builtins): see CXX_FLAGS in runtime/build.py (no sin+cos -> sincos merging).
PLAIN_CALLS = {"std::sin": ("sinf", "sin"), "std::cos": ("cosf", "cos")}


def _operand(a: Term, names: dict[Term, str], target: str, single: bool) -> str:
    if a.op == "const":
        return literal(a.value, target, single)
    return names[a]


def can_compile(t: Term, target: str, table: OpTable | None = None) -> bool:
    """Whether the target can compute `t` inside a kernel."""
    table = table or default_op_table()
    info = table.get(t.op)
    if info is None or t.meta.kind != "tensor":
        return False
    dtypes = TRITON_DTYPES if target == "triton" else CPP_DTYPES
    if t.meta.dtype not in dtypes or (t.meta.dtype == "b8" and t.op not in BOOL_OPS):
        return False
    if t.op == "to":
        # A float-to-float or bool-to-float cast, nothing else (no device, layout or
        # format change).
        src = t.args[0]
        others = [k for k, v in t.attrs if k != "dtype" and v not in (None, False)
                  and not _same_place(k, v, src)]
        narrow = ("f32", "f16", "bf16")  # f64 <-> f32 would need its own rounding
        to = (*narrow, "f64") if src.meta.dtype == "b8" else narrow
        return (src.meta.kind == "tensor" and src.meta.dtype in (*narrow, "b8")
                and t.attr("dtype") in to and t.attr("dtype") in dtypes
                and src.meta.dtype in dtypes and not others and on_device(t, target))
    if t.op == "attention":
        # templates/triton/attention.py.j2; on the CPU attention runs as its ATen ops
        return target == "triton" and on_device(t, target) and t.meta.dtype in FLOATS \
            and t.meta.dtype != "f64"
    if t.op in MATMULS:
        # only the Triton matmul template computes products; on the CPU they stay with BLAS.
        # It accumulates in float32: an f64 product would lose its precision.
        return target == "triton" and on_device(t, target) and t.meta.dtype in FLOATS \
            and t.meta.dtype != "f64" \
            and all(a.meta.kind == "tensor" and a.meta.dtype == t.meta.dtype for a in t.args)
    if t.op in RESHAPES:
        # inside a matmul kernel a reshape of the product is a renaming (MatmulSpace)
        return target == "triton" and on_device(t, target) and t.meta.dtype in FLOATS
    if t.op in ROW_REDUCTIONS:
        pass  # engine/fuse.py checks the reduction's dims; the template renders it
    elif (info.triton if target == "triton" else info.cpp) is None:
        return False
    if any(t.attr(k) != v for k, v in info.kernel_when.items()):
        return False
    for k, v in (() if t.op in ROW_REDUCTIONS else t.attrs):
        if k in info.kernel_when or k == "memory_format":
            continue  # a layout, not a value: the launcher gives the output the root's strides
        if k in info.attrs and not isinstance(v, bool | int | float) and v is not None:
            return False
        exprs = (info.triton or "") + (info.cpp or "")
        if k in info.attrs and v is None and ("{" + k + "}") in exprs:
            return False
    return all(_operand_ok(t, a, dtypes) for a in t.args) and on_device(t, target)


def compilable(target: str, table: OpTable | None = None) -> Callable[[Term], bool] | None:
    """The fuse phase's question to the target: can a kernel compute this term (with
    the ops of `table`, the package's by default)?"""
    if target == "aten":
        return None
    return lambda t: can_compile(t, target, table)


def _same_place(key: str, value: Any, src: Term) -> bool:
    """A `to` attribute that changes nothing: the strided layout, or the source's
    own device (autocast's casts spell both out)."""
    shown = str(getattr(value, "value", value))
    if key == "layout":
        return shown == "torch.strided"
    if key == "device":
        return shown == src.meta.device or src.meta.device.startswith(shown + ":")
    return False


# Ops whose result may be a bool inside a kernel (a mask that a `where` then reads)
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL = ("logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
           "bitwise_not")
BOOL_OPS = (*COMPARISONS, *LOGICAL)


def _operand_ok(t: Term, a: Term, dtypes: dict[str, str]) -> bool:
    """Whether a kernel of a target with `dtypes` computes `t` from operand `a` as
    ATen does."""
    if a.op == "const":
        if not isinstance(a.value, bool | int | float):
            return False
        # ATen compares a half tensor with a number rounded to the tensor's dtype
        return t.op not in COMPARISONS or _exact(a.value, t.args[0].meta.dtype)
    if a.meta.kind != "tensor" or a.meta.dtype not in dtypes:
        return False
    if a.meta.dtype == "b8":
        return t.op in ("where", "masked_fill", "to", *LOGICAL)
    if a.meta.dtype not in FLOATS:
        return False
    if t.meta.dtype == "b8":
        if t.op in LOGICAL:  # bitwise ops of floats do not exist; logical ones test != 0
            return t.op.startswith("logical")
        # comparisons of one float dtype (mixed, ATen would round one side first)
        return all(b.meta.dtype == a.meta.dtype for b in t.args if b.op != "const")
    return a.meta.dtype == t.meta.dtype or _widens(a.meta.dtype, t.meta.dtype)


def _exact(value: Any, dtype: str) -> bool:
    """`value` is the same number in `dtype` (f16 and bf16 round most decimals)."""
    if dtype not in ("f16", "bf16") or isinstance(value, bool) or math.isnan(value):
        return True
    try:
        if dtype == "f16":
            return struct.unpack("<e", struct.pack("<e", value))[0] == value
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
    except (OverflowError, struct.error):
        return False
    # bf16 is f32's upper half: exact when f32 is and the lower half is zero
    return struct.unpack("<f", struct.pack("<f", value))[0] == value and bits & 0xFFFF == 0


# Operand dtypes a float result may be computed from exactly, as ATen's type
# promotion does (bf16 + f32 -> f32: a residual add under autocast). Not the
# other way: an f16 result of an f32 0-dim operand rounds that operand first.
WIDER = {"f16": ("f32", "f64"), "bf16": ("f32", "f64"), "f32": ("f64",)}


def _widens(operand: str, result: str) -> bool:
    return result in WIDER.get(operand, ())


def on_device(t: Term, target: str) -> bool:
    on_cpu = t.meta.device.startswith("cpu")
    if target == "openmp":
        return on_cpu
    # Triton runs CPU tensors only through its interpreter.
    return not on_cpu or os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------ rendering
def render(spec: KernelSpec, target: str, table: OpTable | None = None,
           simd_decls: tuple[str, ...] = ()) -> str:
    """The kernel's source for `target`; `simd_decls` are the vector-math declarations
    the C++ compiler may call (runtime/build.py: vector_math_decls probes them)."""
    table = table or default_op_table()
    ext = "py" if target == "triton" else "cpp"
    if not has_template(f"{target}/{spec.template}.{ext}.j2", spec.template_dirs):
        raise RenderError(f"no {target} template templates/{target}/{spec.template}.{ext}.j2")
    if target == "triton":
        return _render_triton(spec, table)
    return _render_cpp(spec, table, simd_decls)


def render_kind(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
                table: OpTable) -> str:
    """`render` in a Kind's argument order: the render step of the kinds whose
    sources are written here (pointwise and row)."""
    return render(spec, target, table, simd_decls=simd_decls)


def _names(spec: KernelSpec) -> dict[Term, str]:
    names: dict[Term, str] = {}
    for t in spec.body:
        if t.op == "arg":
            names[t] = f"x{t.attr('index')}"
        elif t.op != "const":
            names[t] = f"t{len(names)}"
    return names


def _per_row(t: Term, spec: KernelSpec) -> bool:
    if spec.kind != "row":
        return False
    if t.op == "arg":
        return spec.inputs[t.attr("index")].per_row
    return t.op in ROW_REDUCTIONS or (bool(t.args) and all(
        _per_row(a, spec) for a in t.args if a.op != "const"))


def _header(spec: KernelSpec, target: str, comment: str) -> list[str]:
    return [f"{comment} rewritec kernel {spec.name}",
            f"{comment} rule: {spec.rule} @ {spec.location}",
            f"{comment} template: {template_shown(spec, target)}",
            f"{comment} replaces {spec.replaced_ops} ATen op(s)"]


def template_shown(spec: KernelSpec, target: str) -> str:
    """The template file behind a kernel: `templates/...` for the package's, the
    file's path for one from a user's folder."""
    name = f"{target}/{spec.template}.{'py' if target == 'triton' else 'cpp'}.j2"
    path = template_path(name, spec.template_dirs)
    if path is None or path.parent.parent == TEMPLATES_DIR:
        return f"templates/{name}"
    return str(path)


def _tiled_offsets(spec: KernelSpec) -> tuple[dict[str, str], str]:
    """Offsets for the tiled pointwise template: per input, and the output's."""
    rank, y, x = spec.rank, spec.meta["tile"], spec.rank - 1
    sizes = [sympy.Symbol(f"size{k}", integer=True, positive=True) for k in range(rank)]
    dense = [sympy.Mul(*sizes[k + 1:]) for k in range(rank)]
    zdims = [k for k in range(rank) if k not in (y, x)]

    def offset(strides: list[sympy.Expr]) -> str:
        z = print_index(subspace_offset(zdims, sizes, strides, "z"), "triton") if zdims else "0"
        return (f"{z} + offs_y[:, None] * ({print_index(strides[y], 'triton')}) "
                f"+ offs_x[None, :] * ({print_index(strides[x], 'triton')})")

    out = offset(dense)
    offsets = {}
    for inp in spec.inputs:
        strides = dense if inp.flat else [sympy.Symbol(f"{inp.name}_stride{k}", integer=True)
                                          for k in range(rank)]
        offsets[inp.name] = offset(strides)
    return offsets, out


def _render_triton(spec: KernelSpec, table: OpTable) -> str:
    names = _names(spec)
    tiled = spec.template == "pointwise_tiled"
    if tiled:
        tile_offsets, tile_out = _tiled_offsets(spec)
    compute = "tl.float64" if spec.compute == "f64" else "tl.float32"
    loads, stmts = [], []
    for inp in spec.inputs:
        if tiled:
            off, mask = tile_offsets[inp.name], "mask"
        elif spec.kind == "pointwise":
            off = "offs" if inp.flat else print_index(
                strided_offset(spec.rank, inp.name, "offs"), "triton")
            mask = "mask"
        elif inp.per_row:
            off = "row" if inp.flat else print_index(
                strided_offset(spec.rank, inp.name, "row", skip_last=True), "triton")
            mask = None
        else:
            base = "row * n_cols + cols" if inp.flat else (
                f"{print_index(strided_offset(spec.rank, inp.name, 'row', True), 'triton')} "
                f"+ cols * {inp.name}_stride{spec.rank - 1}")
            off, mask = base, "mask"
        cast = "" if inp.dtype == "b8" else f".to({compute})"
        if inp.dtype in ("f16", "bf16") and spec.compute == "f64":
            cast = f".to(tl.float32){cast}"  # exact; the interpreter has no half -> f64
        m = f", mask={mask}, other=0" if mask else ""
        loads.append(f"x{spec.inputs.index(inp)} = tl.load({inp.name}_ptr + {off}{m}){cast}")
    for t in spec.body:
        if t.op in ("arg", "const"):
            continue
        if t.op in ROW_REDUCTIONS:
            src = names[t.args[0]]
            if t.op in ("sum", "mean"):
                e = f"tl.sum(tl.where(mask, {src}, 0.0), axis=0)"
                if t.op == "mean":
                    e = f"{e} / n_cols"
            else:
                fill = "float('-inf')" if t.op == "amax" else "float('inf')"
                # tl.max drops nan; torch.amax returns nan for a row that has one.
                if int(spec.meta.get("cols") or 0) <= NAN_COMBINE_MAX_COLS:
                    # one reduction whose combine function propagates nan
                    fn = "_max_propagate_nan" if t.op == "amax" else "_min_propagate_nan"
                    e = f"tl.reduce(tl.where(mask, {src}, {fill}), 0, {fn})"
                else:
                    # wide rows: tl.max plus a count of nans is faster there
                    fn = "tl.max" if t.op == "amax" else "tl.min"
                    stmts.append(f"{names[t]}_nan = tl.sum(tl.where(mask & ({src} != {src}),"
                                 f" 1, 0), axis=0) > 0")
                    e = (f"tl.where({names[t]}_nan, float('nan'), "
                         f"{fn}(tl.where(mask, {src}, {fill}), axis=0))")
            stmts.append(f"{names[t]} = {e}")
        else:
            stmts.append(f"{names[t]} = {value_expr(t, names, 'triton', table)}")
    stores = []
    for out, t in zip(spec.outputs, spec.written, strict=True):
        if spec.kind == "pointwise":  # tiled: the template's out_offset
            off, out_mask = "offs", "mask"
        elif out.per_row:
            off, out_mask = "row", None
        else:
            off, out_mask = "row * n_cols + cols", "mask"
        value = names[t]
        if spec.compute == "f64" and out.dtype in ("f16", "bf16"):
            value = f"{value}.to(tl.float32)"  # as loads: the interpreter has no f64 -> half
        stores.append({"ptr": f"{out.name}_ptr", "offset": off, "mask": out_mask,
                       "value": value, "dtype": TRITON_DTYPES[out.dtype]})
    params = [f"{i.name}_ptr" for i in spec.inputs] + [f"{o.name}_ptr" for o in spec.outputs]
    params += ["n_elements"] if spec.kind == "pointwise" else [row_width_param(spec)]
    params += size_params(spec)
    params += [f"{i.name}_stride{k}" for i in spec.inputs if not i.flat for k in range(spec.rank)]
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=_header(spec, "triton", "#"),
                           name=spec.name, params=params, loads=loads, stmts=stmts,
                           stores=stores, out_offset=tile_out if tiled else None,
                           tile_y=spec.meta.get("tile"), tile_x=spec.rank - 1)


def _render_cpp(spec: KernelSpec, table: OpTable, simd_decls: tuple[str, ...]) -> str:
    names = _names(spec)
    ctype = CPP_DTYPES[spec.compute]
    params = [f"const {CPP_DTYPES[i.dtype]}* __restrict__ {i.name}_ptr" for i in spec.inputs]
    # each output in its own dtype (an f32 one of an f64 kernel: stores convert)
    params += [f"{CPP_DTYPES[o.dtype]}* __restrict__ {o.name}_ptr" for o in spec.outputs]
    params += [f"int64_t size{k}" for k in range(spec.rank)]
    params += [f"int64_t {i.name}_stride{k}" for i in spec.inputs if not i.flat
               for k in range(spec.rank)]
    params += ["int64_t n_elements" if spec.kind == "pointwise" else "int64_t n_rows",
               "int64_t n_cols"]

    def load(inp: KInput, idx: int) -> str:
        if spec.kind == "pointwise":
            off = "i" if inp.flat else print_index(strided_offset(spec.rank, inp.name, "i"), "cpp")
        elif inp.per_row:
            off = "r" if inp.flat else print_index(
                strided_offset(spec.rank, inp.name, "r", skip_last=True), "cpp")
        else:
            off = "r * n_cols + c" if inp.flat else (
                f"{print_index(strided_offset(spec.rank, inp.name, 'r', True), 'cpp')} "
                f"+ c * {inp.name}_stride{spec.rank - 1}")
        return f"const {ctype} x{idx} = {inp.name}_ptr[{off}];"

    def stmt(t: Term) -> str:
        return f"const {ctype} {names[t]} = {value_expr(t, names, 'cpp', table)};"

    if spec.kind == "pointwise":
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
            # The loop comes twice: with `c * stride` along the row (gathers) and, when
            # every strided input is contiguous along it (a broadcast bias), with plain
            # vector loads: gelu(x + b) at 256x4096 on 2 cores 0.278 -> 0.224 ms.
            unit_stride = " && ".join(f"{inp.name}_stride{last} == 1" for inp in strided)

            def row_loads(step: str) -> list[str]:
                """Loads at column c, `step` (with {name}) apart in strided inputs."""
                return [f"const {ctype} x{k} = {inp.name}_ptr[" + (
                    "i" if inp.flat else f"{inp.name}_base + " + step.format(name=inp.name))
                    + "];" for k, inp in enumerate(spec.inputs)]

            contiguous = row_loads("c")
            lines = row_loads(f"c * {{name}}_stride{last}")
        compute = [stmt(t) for t in spec.body if t.op not in ("arg", "const")]
        stores = [{"ptr": f"{o.name}_ptr", "value": names[t]}
                  for o, t in zip(spec.outputs, spec.written, strict=True)]
        return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                               header=_header(spec, "openmp", "//"), name=spec.name,
                               params=params, body=lines + compute, stores=stores,
                               rows=bool(row_lines), row_body=row_lines,
                               unit_stride=unit_stride, unit_body=contiguous + compute,
                               simd_decls=simd_decls)
    # Row kernel: per-row values first (loads, then reductions in order, each a loop over
    # the row that recomputes only the element values it needs), then the output loop.
    # A step is a per-row line or a reduction, whose loop the template writes.
    steps: list[dict[str, Any]] = [{"reduce": False, "line": load(inp, k)}
                                   for k, inp in enumerate(spec.inputs) if inp.per_row]
    done: set[Term] = {t for t in spec.body if t.op == "arg" and _per_row(t, spec)}

    def needed(target_terms: list[Term], known: frozenset[Term] = frozenset()) -> list[Term]:
        """Element terms the targets need, in body order, not going past `known`."""
        reach: set[Term] = set()
        stack = list(target_terms)
        while stack:
            u = stack.pop()
            if u not in reach:
                reach.add(u)
                if u not in known:
                    stack.extend(u.args)
        return [t for t in spec.body if t in reach and t not in known and t.op != "const"
                and t not in done and not _per_row(t, spec)]

    # The output loop would recompute what the last reduction's loop computed (the
    # exp of a softmax): that loop stores the latest such value in the output, and
    # the output loop reads it back (softmax 1024x1024: 0.49 -> 0.38 ms on 2 cores).
    reductions = [t for t in spec.body if t.op in ROW_REDUCTIONS]
    written = list(zip(spec.outputs, spec.written, strict=True))
    elements = [t for o, t in written if not o.per_row]  # S-shaped outputs
    kept: Term | None = None
    if reductions and not spec.per_row_out and spec.out_dtype == spec.compute:
        for_output = set(needed(elements))
        shared = [t for t in needed([reductions[-1].args[0]])
                  if t in for_output and t.op != "arg"]
        kept = shared[-1] if shared else None
    # An S-shaped side output is stored by the first loop that computes it; later
    # loops read it back instead of computing it again (the row is one thread's).
    # (Not one narrower than the compute dtype: read back, it would differ.)
    side = {t: f"{o.name}_ptr" for o, t in written[1:]
            if not o.per_row and o.dtype == spec.compute}
    stored: dict[Term, str] = {}

    def elem_lines(targets: list[Term]) -> tuple[list[str], list[Term]]:
        """The lines computing the targets' element values (stored ones read back,
        first), and the terms they compute."""
        terms = needed(targets, frozenset(stored))
        reach = {a for t in [*targets, *terms] for a in (t, *t.args)}
        out = [f"const {ctype} {names[t]} = {stored[t]}[r * n_cols + c];"
               for t in spec.body if t in stored and (t in reach or t is kept)]
        for t in terms:
            if t.op == "arg":
                out.append(load(spec.inputs[t.attr("index")], t.attr("index")))
            else:
                out.append(stmt(t))
        return out, terms

    def store_side(terms: list[Term]) -> list[str]:
        new = [t for t in terms if t in side and t not in stored]
        stored.update((t, side[t]) for t in new)
        return [f"{side[t]}[r * n_cols + c] = {names[t]};" for t in new]

    for t in spec.body:
        if t.op in ("arg", "const") or t in done:
            continue
        if t.op in ROW_REDUCTIONS:
            acc = cpp_accumulator(t.op, f"{names[t]}_acc", ctype)
            lines, terms = elem_lines([t.args[0]])
            body = lines + acc.update(names[t.args[0]]) + store_side(terms)
            if kept is not None and t is reductions[-1]:
                body.append(f"out_ptr[r * n_cols + c] = {names[kept]};  // read back below")
            steps.append({"reduce": True, "pairwise": acc.pairwise, "declare": acc.declare(),
                          "thread_init": acc.thread_init(), "chunk_init": acc.chunk_init(),
                          "clauses": acc.clauses(), "body": body, "chunk_end": acc.chunk_end(),
                          "thread_end": acc.thread_end(), "single_end": acc.single_end(),
                          "finish": acc.finish(names[t], "n_cols" if t.op == "mean" else None)})
            done.add(t)
        elif _per_row(t, spec):
            steps.append({"reduce": False, "line": stmt(t)})
            done.add(t)
    if kept is not None:
        stored[kept] = "out_ptr"
    finals = [t for t in elements if t not in stored]  # what the output loop stores
    out_lines = elem_lines(finals)[0] if finals else []
    row_stores = [{"ptr": f"{o.name}_ptr", "value": names[t]} for o, t in written if o.per_row]
    elem_stores = [{"ptr": f"{o.name}_ptr", "value": names[t]} for o, t in written
                   if t in finals]
    return render_template(f"openmp/{spec.template}.cpp.j2", spec.template_dirs,
                           header=_header(spec, "openmp", "//"),
                           name=spec.name, params=params, row_steps=steps,
                           chunk=PAIRWISE_CHUNK, elem_body=out_lines, row_stores=row_stores,
                           elem_stores=elem_stores, simd_decls=simd_decls)
