"""What the kinds share, from a `kernel` term to kernel source: Python computes
every expression, the templates under `templates/triton/` and `templates/openmp/`
lay them out.

Here: the spec of pointwise and row kernels (`spec_of`), index and value
expressions, whether a target can compute a term (`can_compile`), and the pieces
with which each kind's own render (kinds/pointwise.py, pointwise_tiled.py, row.py,
row_looped.py) writes its loads, statements and stores. A kernel iterates over one
space:
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
from typing import Any

import sympy

from ..engine.fuse import (
    FLOATS,
    INTS,
    MATMULS,
    RESHAPES,
    ROW_REDUCTIONS,
    body_terms,
    counts,
    kernel_outputs,
    static_shape,
)
from ..engine.ops import OpTable, default_op_table
from ..engine.term import Term
from .spec import KernelSpec, KInput, KOutput, size_params, static_width
from .templates import TEMPLATES_DIR, has_template, template_path

TRITON_DTYPES = {"f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16",
                 "f64": "tl.float64", "b8": "tl.int1", "i64": "tl.int64", "i32": "tl.int32"}
CPP_DTYPES = {"f32": "float", "f64": "double", "b8": "bool", "i64": "int64_t",
              "i32": "int32_t", "bf16": "uint16_t"}
# bf16 in C++: 16-bit words that a kernel reads into float (`rw_from_bf16`,
# cpp_read) and writes from one (`rw_to_bf16`, cpp_write), rounding to nearest even
# (nan stays nan), as ATen rounds. Kernel arithmetic runs in float and each
# bf16-typed op's result is rounded (`rw_round_bf16`, value_expr), as ATen's CPU
# kernels round each op: a fused chain gives eager's values. Bit operations and a
# selection by mask, no branches, so loops still vectorize. (f16 stays with ATen
# on the CPU: written the same way, GCC 12 left its conversions' loops scalar,
# 100x slower than ATen's; CPU autocast's dtype is bf16.) Put before a kernel that
# uses it (`kernel_header`).
CPP_BF16 = r"""#include <cstdint>
static inline float rw_bits_float(uint32_t u) { return __builtin_bit_cast(float, u); }
static inline uint32_t rw_float_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
static inline float rw_from_bf16(uint16_t h) { return rw_bits_float((uint32_t)h << 16); }
static inline uint16_t rw_to_bf16(float f) {
    const uint32_t u = rw_float_bits(f);
    const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = 0u - (uint32_t)((u & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((((u >> 16) | 0x40u) & nan) | (nearest & ~nan));
}
static inline float rw_round_bf16(float x) { return rw_from_bf16(rw_to_bf16(x)); }"""

# Integer values (engine/fuse.py: INTS) load as they are, never as floats (exact
# past 2**24), and kernels compute them in their own dtype, as ATen does: these
# ops of integers of one dtype and int constants (a loss's labels shifted and
# masked, a step counter), comparisons of them (class indices against column
# positions: nll_loss, frontend/decompositions.py), casts to and from them, and
# the indexed ops (copies); a sum of a mask is a count (engine/fuse.py: counts).
# Integer division, remainders, shifts and other integer sums stay with ATen.
INT_OPS = ("add", "sub", "mul", "neg", "abs", "maximum", "minimum", "where", "masked_fill",
           "clone", "full", "full_like")
# ops of one value everywhere, of any dtype (value_expr writes it as a literal)
FILLS = ("full", "full_like")


def load_cast(dtype: str, compute: str) -> str:
    """What a Triton load of a `dtype` input appends: a cast into the compute
    dtype, none for masks and integers."""
    return "" if dtype == "b8" or dtype in INTS else f".to({compute})"


def cpp_value_type(dtype: str, ctype: str) -> str:
    """The C++ type a value of `dtype` lives in: the compute type `ctype`, or the
    integer's own."""
    return CPP_DTYPES[dtype] if dtype in INTS else ctype


def cpp_read(dtype: str, expr: str) -> str:
    """A C++ load of `expr` (an element of a `dtype` tensor) as the kernel computes it."""
    return f"rw_from_{dtype}({expr})" if dtype == "bf16" else expr


def cpp_write(dtype: str, value: str) -> str:
    """What a C++ kernel stores into a `dtype` tensor for the computed `value`."""
    return f"rw_to_{dtype}({value})" if dtype == "bf16" else value


SAFE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RenderError(Exception):
    """The group cannot be rendered by this target; it falls back to ATen."""


def whole(v: Any) -> bool:
    """An int and not a bool (a Python bool is an int): a dim, a pad, an integer."""
    return isinstance(v, int) and not isinstance(v, bool)


def aligned_shape(t: Term, rank: int) -> tuple[Any, ...]:
    """`t`'s shape with leading 1s up to `rank` dims, as broadcasting aligns it."""
    return (1,) * (rank - t.meta.rank) + tuple(t.meta.shape)


def take_dim(t: Term, rank: int) -> int:
    """The dim of a kernel space of `rank` dims along which take `t` reads its table
    where the index points (operands aligned from the right, as `aligned_shape`)."""
    return int(t.attr("dim")) % t.meta.rank + rank - t.meta.rank


def triton_take_assert(inside: str) -> str:
    """The device assert of a take's index in a Triton kernel (`inside`: the index is
    in range, or the lane is masked): active where the kernel is compiled with
    Triton's `debug` (runtime/recipe.py: triton_options)."""
    return f'tl.device_assert({inside}, "rewritec: an index of a take is out of range")'


# Ops that read an operand at other positions (the op table's `indexed` category),
# which pointwise kernels compute (kinds/indexed.py), and the views among them: a
# `slice` joins a pointwise kernel that holds one of the others (kinds/pointwise.py).
INDEXED_OPS = ("cat", "slice_scatter", "slice_backward", "constant_pad_nd", "take")
MOVES = (*INDEXED_OPS, "slice")


def _indexed_computable(t: Term) -> bool:
    """Whether a kernel computes indexed op `t` (or a slice) as ATen does: static
    shapes, a step of 1, and (cat) pieces that differ only along the cat's dim (not
    the 1-d empty tensors cat skips)."""
    if not all(a.meta.kind == "tensor" and static_shape(a.meta.shape) for a in t.args) \
            or not static_shape(t.meta.shape):
        return False
    if t.op == "constant_pad_nd":
        return _pad_computable(t)
    dim, rank = t.attr("dim"), t.meta.rank
    if not whole(dim) or not -rank <= dim < rank:
        return False
    if t.op == "take":
        # x at the index's values (kinds/indexed.py: Plan._take): operands aligned from
        # the right, as aten/take.py's shape rule checked when the term was made
        x, index = t.args
        return index.meta.rank == rank and x.meta.rank <= rank
    if t.op == "cat":
        d = dim % rank
        return len(t.args) >= 2 and all(
            a.meta.rank == rank and all(a.meta.shape[k] == t.meta.shape[k]
                                        for k in range(rank) if k != d) for a in t.args)
    if t.attr("step") != 1 or not all(v is None or (isinstance(v, int) and not isinstance(
            v, bool)) for v in (t.attr("start"), t.attr("end"))):
        return False
    if t.op == "slice_scatter":
        return tuple(t.args[0].meta.shape) == tuple(t.meta.shape) \
            and t.args[1].meta.rank == rank
    if t.op == "slice_backward":
        return tuple(t.attr("input_sizes")) == tuple(t.meta.shape) \
            and t.args[0].meta.rank == rank
    return t.op == "slice"


def pad_widths(t: Term) -> list[tuple[int, int]]:
    """A constant_pad_nd's (before, after) per dim, outermost first, 0s where it
    pads nothing (its `pad` lists them from the last dim back; negative: a crop)."""
    pad = list(t.attr("pad"))
    pairs = [(pad[k], pad[k + 1]) for k in range(0, len(pad), 2)]
    return [(0, 0)] * (t.meta.rank - len(pairs)) + pairs[::-1]


def _pad_computable(t: Term) -> bool:
    """constant_pad_nd as ATen computes it: int pads, at most two a dim, and a fill
    value the tensor's dtype holds exactly (an integer for an integer tensor)."""
    pad, value, src = t.attr("pad"), t.attr("value"), t.args[0]
    if not isinstance(pad, tuple | list) or len(pad) % 2 or len(pad) > 2 * t.meta.rank \
            or not all(whole(p) for p in pad) \
            or src.meta.rank != t.meta.rank:
        return False
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return _holds(value, t.meta.dtype)


def _holds(value: int | float, dtype: str) -> bool:
    """`dtype` holds `value` as it is: an integer for an integer dtype, a number f16
    and bf16 do not round (a pad's or a fill's value, written as a literal)."""
    if dtype in INTS:
        return math.isfinite(value) and float(value).is_integer()
    return _exact(value, dtype)


def spec_of(term: Term, index: int, kind: str,
            rows: tuple[int, tuple[Any, ...]] | None = None) -> KernelSpec:
    """The spec of a kernel term over its root's elements (kinds/pointwise.py), or,
    given `rows` = (dim, shape), over the rows along `dim` of `shape` (kinds/row.py).
    `kind` names the spec's kind."""
    body = body_terms(term)
    root = term.attr("body")
    dim, shape = rows if rows is not None else (None, tuple(root.meta.shape))
    rank = len(shape)
    # Row kernels run along `dim` moved last (the launcher permutes sizes and
    # strides), so inputs are read flat only when `dim` already is last.
    last = dim is None or dim == rank - 1
    per_row_shape = shape[:dim] + (1,) + shape[dim + 1:] if dim is not None else None
    # Pointwise kernels run in the memory order of their output's layout (the
    # strides ATen gives the root, e.g. NHWC after a channels_last convolution):
    # the launcher allocates the output so and permutes sizes and strides to it.
    order = None if dim is not None else dense_order(root.meta.shape, root.meta.strides)
    # Indexed ops read inputs at other positions: through their strides, always
    indexed = any(t.op in MOVES for t in body)
    inputs = []
    for i, a in enumerate(term.args):
        ashape = aligned_shape(a, rank)
        per_row = dim is not None and ashape[dim] == 1 and shape[dim] != 1
        flat = last and not indexed and a.meta.rank == rank and _contiguous(a, order) and (
            ashape == shape or (per_row and ashape == per_row_shape))
        shared = dim is not None and not per_row and any(
            shape[k] != 1 for k in range(rank) if k != dim) and all(
            ashape[k] == 1 for k in range(rank) if k != dim)
        inputs.append(KInput(f"in{i}", a.meta.dtype, flat, per_row, rank, shared))
    tile = _tile_dim(term, order, rank) if dim is None and not indexed else None
    ops = [t for t in body if t.op not in ("arg", "const")]
    written = list(kernel_outputs(term))
    outputs = [KOutput("out" if k == 0 else f"out{k}", t.meta.dtype,
                       dim is not None and tuple(t.meta.shape) != shape, tuple(t.meta.shape))
               for k, t in enumerate(written)]
    key: tuple[Any, ...] = (term.attr("rule"), [_key(t) for t in body], rank, dim, tile,
                            [(x.dtype, x.flat, x.per_row) for x in inputs])
    if len(written) > 1:  # one output keeps the names (and caches) it always had
        key += (tuple(body.index(t) for t in written),)
    digest = hashlib.sha256(repr(key).encode())
    name = f"k{index}_{term.attr('rule').replace('-', '_')}_{digest.hexdigest()[:8]}"
    meta = {"dim": dim, "shape": shape, "order": order, "tile": tile,
            # the named rewrites the variants pass applied (kinds/kind.py)
            "rewrites": term.attr("rewrites", ())}
    if indexed:  # the launcher takes the (static) shape from here, not from the inputs
        meta["indexed"] = True
    # each take's index input and the size its values must stay below: the OpenMP
    # launcher checks them before a launch (runtime/launch.py: check_bounds)
    bounds = {(t.args[1].attr("index"), aligned_shape(t.args[0], rank)[take_dim(t, rank)])
              for t in body if t.op == "take" and t.args[1].op == "arg"}
    if bounds:
        meta["bounds"] = tuple(sorted(bounds))
    if any(t.op == "full" for t in body):  # a fill has sizes no input need have
        if not static_shape(shape):
            raise RenderError("a fill in a kernel of symbolic sizes: its sizes are not known")
        meta["filled"] = True
    return KernelSpec(name=name, kind=kind, rule=term.attr("rule"),
                      location=term.attr("location"), template=term.attr("kind"),
                      template_dir=term.attr("template_dir"),
                      inputs=inputs, body=body, root=root, outputs=outputs, written=written,
                      rank=rank, replaced_ops=len(ops), meta=meta)


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
        # read along the space's innermost dim at one place (a per-row value: [N, 1]
        # or its expand, stride 0) or contiguously: a flat loop reads it as well
        if a.meta.shape[space[-1]] == 1 or a.meta.strides[space[-1]] in (0, 1):
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
            if value == 0 and math.copysign(1.0, value) < 0:
                # Triton makes every float constant equal to 0 a +0.0: -0.0 is its bits
                bits, ints, floats = (("-2147483648", "tl.int32", "tl.float32") if single
                                      else ("-9223372036854775808", "tl.int64", "tl.float64"))
                return f"tl.full([], {bits}, {ints}).to({floats}, bitcast=True)"
            return repr(value)
        return f"{value!r}f" if single else repr(value)
    raise RenderError(f"no {target} literal for {value!r}")


def value_expr(t: Term, names: dict[Term, str], target: str, table: OpTable) -> str:
    """The expression computing `t` from its operands' names."""
    if t.op == "to":
        # Values live in the compute dtype (integers in their own); a cast to a
        # narrower float rounds, one to an integer truncates, as C++'s does.
        x = _operand(t.args[0], names, target, True)
        dtype, src = t.attr("dtype"), t.args[0].meta.dtype
        if dtype in INTS:
            return f"{x}.to({TRITON_DTYPES[dtype]})" if target == "triton" \
                else f"(({CPP_DTYPES[dtype]})({x}))"
        if src in INTS:  # rounded to float32 first, as ATen converts an integer
            x = f"{x}.to(tl.float32)" if target == "triton" else f"((float)({x}))"
        if src == "b8":  # a mask as a number: 0.0 or 1.0
            return f"{x}.to(tl.float32)" if target == "triton" else f"({x} ? 1.0 : 0.0)"
        if dtype in ("f16", "bf16") and target == "triton":
            return f"{x}.to({TRITON_DTYPES[dtype]}).to(tl.float32)"
        if dtype == "bf16":
            return f"rw_round_bf16({x})"
        return x
    if t.op in FILLS:  # the fill as its dtype holds it: 1 -> 1.0 in f32
        return literal(_as_dtype(t.attr("fill_value"), t.meta.dtype), target,
                       t.meta.dtype != "f64")
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
        if t.meta.dtype == "bf16":
            # ATen's CPU kernels compute a bf16 op in float and round its result:
            # so does each op of a kernel, and a chain gives eager's values
            return f"rw_round_bf16({expr})"
    return "(" + expr + ")"


# C++ calls spelled by name, not through <cmath>'s overloads (which are GCC
# builtins): see CXX_FLAGS in runtime/build.py (no sin+cos -> sincos merging).
PLAIN_CALLS = {"std::sin": ("sinf", "sin"), "std::cos": ("cosf", "cos")}


def _as_dtype(value: Any, dtype: str) -> Any:
    if dtype == "b8":
        return bool(value)
    return int(value) if dtype in INTS else float(value)


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
    # A kernel's arguments are on its device: a 0-d CPU tensor in a CUDA op (a clamp's
    # bound, a copied start token) leaves that op to ATen, which takes it so.
    if any(a.meta.kind == "tensor" and a.meta.device != t.meta.device for a in t.args):
        return False
    dtypes = TRITON_DTYPES if target == "triton" else CPP_DTYPES
    if t.meta.dtype not in dtypes or (t.meta.dtype in INTS and t.op not in (
            *INT_OPS, *MOVES, "to", "iota") and not counts(t)) or (
            t.meta.dtype == "b8" and t.op not in (*BOOL_OPS, *FILLS)):
        return False
    if t.op in FILLS:
        # a literal of the fill's dtype: one the dtype holds exactly (an f16 or bf16
        # fill of 0.1 stays ATen's, whose rounding the literal would not repeat)
        value = t.attr("fill_value")
        return isinstance(value, int | float) and on_device(t, target) and (
            t.meta.dtype == "b8" or _holds(value, t.meta.dtype))
    if t.op == "to":
        # A cast between floats, from a bool to a float or an integer, and between
        # integers and floats, nothing else (no device, layout or format change; the
        # front end writes attributes that change nothing as None: aten/convert.py,
        # _plain_cast).
        src = t.args[0]
        others = [k for k, v in t.attrs if k != "dtype" and v not in (None, False)]
        narrow = ("f32", "f16", "bf16")  # f64 <-> f32 would need its own rounding
        to = (*narrow, *INTS) if src.meta.dtype in (*narrow, *INTS) else \
            (*narrow, "f64", *INTS)
        return (src.meta.kind == "tensor" and src.meta.dtype in (*narrow, "b8", *INTS)
                and t.attr("dtype") in to and t.attr("dtype") in dtypes
                and src.meta.dtype in dtypes and not others and on_device(t, target))
    if t.op == "iota":
        # computed from a row kernel's column index (kinds/row.py: RowSpace)
        return t.meta.dtype in INTS and all(whole(t.attr(k)) for k in ("start", "step", "dim")) \
            and on_device(t, target)
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
    if t.op == "take":
        # x's values where an integer index points: x of the result's dtype
        x, index = t.args
        return (t.meta.dtype in FLOATS or t.meta.dtype in INTS) and t.meta.dtype in dtypes \
            and _indexed_computable(t) and on_device(t, target) \
            and x.meta.kind == "tensor" and x.meta.dtype == t.meta.dtype \
            and index.meta.kind == "tensor" and index.meta.dtype in ("i32", "i64")
    if t.op in MOVES:
        # copies of values, at other positions: in pointwise kernels (kinds/indexed.py)
        return (t.meta.dtype in FLOATS or t.meta.dtype in INTS) and _indexed_computable(t) \
            and on_device(t, target) and all(_operand_ok(t, a, dtypes) for a in t.args)
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
        if k in info.attrs and t.meta.dtype in INTS and isinstance(v, float):
            return False  # an integer op's alpha or fill value is an integer
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
        if t.meta.dtype in INTS and not whole(a.value):
            return False
        # ATen compares a half tensor with a number rounded to the tensor's dtype
        return t.op not in COMPARISONS or _exact(a.value, t.args[0].meta.dtype)
    if a.meta.kind != "tensor" or a.meta.dtype not in dtypes:
        return False
    if a.meta.dtype == "b8":
        return t.op in ("where", "masked_fill", "to", *LOGICAL) or counts(t)
    if a.meta.dtype in INTS:
        # compared with, or combined with, integers of its dtype and int constants
        if t.op == "to":
            return True
        if t.op not in COMPARISONS and t.meta.dtype != a.meta.dtype:
            return False
        return all(whole(b.value) if b.op == "const" else b.meta.dtype == a.meta.dtype or (
                       b.meta.dtype == "b8" and t.op in ("where", "masked_fill"))
                   for b in t.args)
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
# What the kinds that write loads, statements and stores for a template share
# (kinds/pointwise.py, pointwise_tiled.py, row.py, row_looped.py); each kind's
# module owns its render.
def check_template(spec: KernelSpec, target: str) -> None:
    """A RenderError unless the kind has a template for `target` (the user's or
    the package's)."""
    ext = "py" if target == "triton" else "cpp"
    if not has_template(f"{target}/{spec.template}.{ext}.j2", spec.template_dirs):
        raise RenderError(f"no {target} template templates/{target}/{spec.template}.{ext}.j2")


def term_names(spec: KernelSpec) -> dict[Term, str]:
    """Each body term's variable in kernel source: x<k> for input k, t<n> for the rest."""
    names: dict[Term, str] = {}
    for t in spec.body:
        if t.op == "arg":
            names[t] = f"x{t.attr('index')}"
        elif t.op != "const":
            names[t] = f"t{len(names)}"
    return names


def per_row(t: Term, spec: KernelSpec) -> bool:
    """In a row kernel: whether `t` is one value per row (a reduction's result, a
    per-row input, or computed from such values only)."""
    if t.op == "arg":
        return spec.inputs[t.attr("index")].per_row
    return t.op in ROW_REDUCTIONS or (bool(t.args) and all(
        per_row(a, spec) for a in t.args if a.op != "const"))


def kernel_header(spec: KernelSpec, target: str, comment: str) -> list[str]:
    """The lines a template puts first: what the kernel is and, in C++, the 16-bit
    bf16 conversions where it reads, writes or rounds to bf16 (CPP_BF16)."""
    lines = [f"{comment} rewritec kernel {spec.symbol}",
             f"{comment} rule: {spec.rule} @ {spec.location}",
             f"{comment} template: {template_shown(spec, target)}",
             f"{comment} replaces {spec.replaced_ops} ATen op(s)"]
    if target != "triton" and _uses_bf16(spec):
        lines += CPP_BF16.splitlines()
    return lines


def _uses_bf16(spec: KernelSpec) -> bool:
    dtypes = [x.dtype for x in spec.inputs] + [o.dtype for o in spec.outputs]
    return "bf16" in dtypes or any(t.meta.dtype == "bf16" for t in spec.body)


def template_shown(spec: KernelSpec, target: str) -> str:
    """The template file behind a kernel: `templates/...` for the package's, the
    file's path for one from a user's folder."""
    name = f"{target}/{spec.template}.{'py' if target == 'triton' else 'cpp'}.j2"
    path = template_path(name, spec.template_dirs)
    if path is None or path.parent.parent == TEMPLATES_DIR:
        return f"templates/{name}"
    return str(path)


def triton_load(spec: KernelSpec, k: int, off: str, mask: str | None,
                name: str | None = None) -> str:
    """Input k loaded at `off` (masked by `mask`, if any) into the compute dtype, as
    variable `name` (x{k} by default)."""
    inp = spec.inputs[k]
    compute = "tl.float64" if spec.compute == "f64" else "tl.float32"
    cast = load_cast(inp.dtype, compute)
    if inp.dtype in ("f16", "bf16") and spec.compute == "f64":
        cast = f".to(tl.float32){cast}"  # exact; the interpreter has no half -> f64
    m = f", mask={mask}, other=0" if mask else ""
    return f"{name or f'x{k}'} = tl.load({inp.name}_ptr + {off}{m}){cast}"


def triton_statement(t: Term, names: dict[Term, str], table: OpTable) -> str:
    return f"{names[t]} = {value_expr(t, names, 'triton', table)}"


def triton_store(spec: KernelSpec, out: KOutput, value: str, off: str,
                 mask: str | None) -> dict[str, Any]:
    """What a Triton template stores of one output: `value` at `off`."""
    if spec.compute == "f64" and out.dtype in ("f16", "bf16"):
        value = f"{value}.to(tl.float32)"  # as loads: the interpreter has no f64 -> half
    return {"ptr": f"{out.name}_ptr", "offset": off, "mask": mask, "value": value,
            "dtype": TRITON_DTYPES[out.dtype]}


def triton_params(spec: KernelSpec, extent: str) -> list[str]:
    """Pointers, the extent (`n_elements`, or a row's width), sizes, strides."""
    params = [f"{i.name}_ptr" for i in spec.inputs] + [f"{o.name}_ptr" for o in spec.outputs]
    params += [extent]
    params += size_params(spec)
    params += [f"{i.name}_stride{k}" for i in spec.inputs if not i.flat for k in range(spec.rank)]
    return params


def cpp_statement(t: Term, names: dict[Term, str], ctype: str, table: OpTable) -> str:
    """`t`'s C++ statement: a variable of the compute type `ctype`, or of its integer
    dtype."""
    return f"const {cpp_value_type(t.meta.dtype, ctype)} {names[t]} = " \
        f"{value_expr(t, names, 'cpp', table)};"


def cpp_params(spec: KernelSpec, extent: str) -> list[str]:
    """Pointers, sizes, strides, then `extent` (the loop's count) and `n_cols`."""
    params = [f"const {CPP_DTYPES[i.dtype]}* __restrict__ {i.name}_ptr" for i in spec.inputs]
    # each output in its own dtype (an f32 one of an f64 kernel: stores convert)
    params += [f"{CPP_DTYPES[o.dtype]}* __restrict__ {o.name}_ptr" for o in spec.outputs]
    params += [f"int64_t size{k}" for k in range(spec.rank)]
    params += [f"int64_t {i.name}_stride{k}" for i in spec.inputs if not i.flat
               for k in range(spec.rank)]
    return [*params, f"int64_t {extent}", "int64_t n_cols"]
