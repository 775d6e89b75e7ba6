"""Random small PyTorch programs for differential fuzzing of rewritec.

A program is a `Graph`: a tuple of statements, each either an `Input` (a
function argument: shape, dtype, memory layout, kind of values) or an `Op`
(an op applied to earlier statements, by index, with its parameters). The
description is made of plain tuples, strings and numbers, so it is hashable,
prints as valid Python (paste a falsifying example straight into a
regression test) and hypothesis can shrink it.

    graph = Graph(stmts=(Input((7, 5)), Op("softmax", (0,)), Op("add", (1, 0))))
    check_graph(graph, {"target": "aten"})     # compiled (strict) == eager

`graphs()` is the hypothesis strategy. It builds each program statement by
statement and runs every candidate op on small real tensors while it draws,
so every description it yields is a valid program (shapes, dtypes, view
constraints) whatever the drawn parameters were.

`check_graph` compiles the program with `rewritec.compile(fn, strict=True,
**options)` (strict: any fallback, of a graph or of one kernel, is an error)
and compares with eager PyTorch: outputs (values, dtypes, shapes), for
`grad=True` programs the gradients of every input, and memory sharing (no
two outputs, or an output and an input, may share memory unless eager's do).
Programs with `params` are modules whose parameters inference graphs freeze;
they run twice, with an in-place parameter update in between. Where the
plain tolerance is exceeded, a float64 run of the same program says who is
right: a compiled result at most `REF_SLACK` times further from it than
eager's still passes (sums reassociated by a kernel, a decomposition rounding
in a different place).

`shrink` minimizes a failing program greedily (drop statements, bypass ops,
simplify inputs) while it fails the same way; scripts/fuzz_long.py uses it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

# Hypothesis caches what it reads from source files under ./.hypothesis; a test
# run writes nothing into the repository (set HYPOTHESIS_STORAGE_DIRECTORY to keep it).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      tempfile.mkdtemp(prefix="rewritec-hypothesis-"))

import rewritec
import torch
import torch.nn.functional as F
from hypothesis import reject
from hypothesis import strategies as st
from rewritec import report
from rewritec.compiler import RewritecWarning

# --------------------------------------------------------------------------- options
# The compile options every fuzz test runs under. "auto" picks the kernel
# generator for the device (openmp on CPU), "triton" on CPU tensors needs
# Triton's interpreter (tests/conftest.py turns it on where there is no GPU).
TARGET_OPTIONS: list[dict[str, Any]] = [{"target": "aten"}, {"target": "auto"}]
if os.environ.get("TRITON_INTERPRET") == "1":
    TARGET_OPTIONS.append({"target": "triton"})


def options_id(opts: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(opts.items()))


# --------------------------------------------------------------------------- description
def _short_repr(rec: Any) -> str:
    """`Input((7, 5), 'f16', 't')`: positional fields, trailing defaults left out."""
    vals = list(rec)
    defaults = rec._field_defaults
    while vals and rec._fields[len(vals) - 1] in defaults \
            and vals[-1] == defaults[rec._fields[len(vals) - 1]]:
        vals.pop()
    return f"{type(rec).__name__}({', '.join(repr(v) for v in vals)})"


class Input(NamedTuple):
    """A function argument.

    layout: contig | t (last two dims transposed) | step (last dim sliced ::2)
            | offset (storage offset 1 on dim 0) | expand (stride 0 on the first dim > 1)
    values: randn | special (randn with inf, -inf, nan, 0.0 and -0.0 mixed in; for an
            integer dtype, its smallest and largest values, 0 and -1) | rand (uniform
            in [0, 1): sums that grow with their length) | fill (0.1 everywhere: a
            sum accumulated one element after another drifts)
    """

    shape: tuple[int, ...]
    dtype: str = "f32"
    layout: str = "contig"
    values: str = "randn"

    def __repr__(self) -> str:
        return _short_repr(self)


class Op(NamedTuple):
    """`op` applied to the statements numbered `args`; `params` are op-specific."""

    op: str
    args: tuple[int, ...]
    params: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return _short_repr(self)


class Graph(NamedTuple):
    stmts: tuple[Input | Op, ...]
    # Statements the function returns (by default: every op result no later op reads).
    outputs: tuple[int, ...] | None = None
    # Also compare gradients: every input requires grad, backward with random cotangents.
    grad: bool = False
    # Inputs (statement ids) that are parameters of a module rather than arguments:
    # inference graphs freeze them with `freeze=True` (and must notice when they change).
    params: tuple[int, ...] = ()
    # Run eager and compiled under torch.autocast("cpu", this dtype): "bf16" or "f16".
    autocast: str | None = None

    def __repr__(self) -> str:
        stmts = "".join(f"\n    {s!r}," for s in self.stmts)
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("outputs", "grad", "params",
                                                                  "autocast")
                        if getattr(self, k) != self._field_defaults[k])
        return f"Graph(({stmts}\n){extra})"

    def output_ids(self) -> tuple[int, ...]:
        if self.outputs is not None:
            return self.outputs
        used = {a for s in self.stmts if isinstance(s, Op) for a in s.args}
        return tuple(i for i, s in enumerate(self.stmts) if isinstance(s, Op) and i not in used)

    def inputs(self) -> list[tuple[int, Input]]:
        return [(i, s) for i, s in enumerate(self.stmts) if isinstance(s, Input)]

    def ops(self) -> list[Op]:
        return [s for s in self.stmts if isinstance(s, Op)]


DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16,
    "i8": torch.int8, "i32": torch.int32, "i64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INT_DTYPES = ("i8", "i32", "i64")
# Compiled vs eager, by the least precise dtype anywhere in the program: integers
# exactly (an integer result has no rounding to excuse).
TOLERANCES: dict[str, dict[str, float]] = {
    "i8": {"rtol": 0.0, "atol": 0.0},
    "i32": {"rtol": 0.0, "atol": 0.0},
    "i64": {"rtol": 0.0, "atol": 0.0},
    "f64": {"rtol": 1e-7, "atol": 1e-7},
    "f32": {"rtol": 1e-4, "atol": 1e-4},
    "bf16": {"rtol": 2e-2, "atol": 2e-2},
    "f16": {"rtol": 1e-2, "atol": 1e-2},
}
_PRECISION = ["i64", "i32", "i8", "f64", "f32", "f16", "bf16"]  # most to least precise
# Ops after which the sign of a zero result is the kernel's choice as much as ATen's
# (an accumulator's start, BLAS): programs with any of them skip the signed-zero check.
SIGNED_ZERO_FREE = ("sum", "mean", "softmax", "log_softmax", "layer_norm", "batch_norm",
                    "cross_entropy", "mm",
                    "bmm", "matmul", "conv2d", "sdpa")
# A compiled value at most this many times further from the float64 run than
# eager's value (plus the tolerance) is a rounding difference, not a bug.
REF_SLACK = 4.0

# --------------------------------------------------------------------------- ops
_CMP: dict[str, Callable[[Any, Any], Any]] = {
    "lt": torch.lt, "gt": torch.gt, "le": torch.le, "ge": torch.ge, "eq": torch.eq,
    "ne": torch.ne,
}


def _unary(name: str, x: torch.Tensor, p: tuple[Any, ...]) -> torch.Tensor:
    if name == "neg":
        return -x
    if name == "abs":
        return x.abs()
    if name == "exp":
        return torch.exp(x)
    if name == "log":
        return torch.log(x)
    if name == "log_abs1":
        return torch.log(x.abs() + 1)
    if name == "sqrt_abs":
        return torch.sqrt(x.abs())
    if name == "sin":
        return torch.sin(x)
    if name == "cos":
        return torch.cos(x)
    if name == "tanh":
        return torch.tanh(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return F.gelu(x, approximate=p[0])
    if name == "silu":
        return F.silu(x)
    if name == "clamp":
        return torch.clamp(x, min=p[0], max=p[1])
    if name == "pow":
        return x ** p[0]
    if name == "cast":
        return x.to(DTYPES[p[0]])
    if name == "contiguous":
        return x.contiguous()
    raise KeyError(name)


def _scalar(name: str, x: torch.Tensor, s: float) -> torch.Tensor:
    if name == "add_s":
        return x + s
    if name == "sub_s":
        return x - s
    if name == "rsub_s":
        return s - x
    if name == "mul_s":
        return x * s
    if name == "div_s":
        return x / s
    raise KeyError(name)


def _binary(name: str, a: torch.Tensor, b: torch.Tensor, p: tuple[Any, ...]) -> torch.Tensor:
    if name == "add":
        return torch.add(a, b, alpha=p[0]) if p and p[0] != 1 else a + b
    if name == "sub":
        return torch.sub(a, b, alpha=p[0]) if p and p[0] != 1 else a - b
    if name == "mul":
        return a * b
    if name == "div":
        return a / b
    if name == "maximum":
        return torch.maximum(a, b)
    if name == "where":
        return torch.where(_CMP[p[0]](a, b), a, b)
    # bool masks that kernels compute inside (comparisons, logical and bitwise ops)
    if name == "where_and":
        return torch.where((a > b) & (b <= 0.5), a, -b)
    if name == "where_or":
        return torch.where(torch.logical_or(a < 0, ~(b > 1.0)), a, b)
    if name == "mask_mul":
        return a * (b > 0).to(a.dtype if a.is_floating_point() else torch.float32)
    if name == "clamp_t":  # a tensor bound (rules/decompose/activations.yaml)
        return torch.clamp_min(a, b) if p[0] == "min" else torch.clamp_max(a, b)
    if name == "mm":
        return torch.mm(a, b)
    if name == "bmm":
        return torch.bmm(a, b)
    if name == "matmul":
        return a @ b
    raise KeyError(name)


UNARY = ("neg", "abs", "exp", "log_abs1", "sqrt_abs", "sin", "cos", "tanh", "sigmoid", "relu",
         "gelu", "silu", "clamp", "pow", "cast", "contiguous")
SCALAR = ("add_s", "sub_s", "rsub_s", "mul_s", "div_s")
BINARY = ("add", "sub", "mul", "div", "maximum", "where", "where_and", "where_or", "mask_mul",
          "clamp_t")
REDUCE = ("sum", "mean", "amax", "amin")
LASTDIM = ("softmax", "log_softmax", "layer_norm")
VIEWS = ("transpose", "permute", "reshape", "view", "expand", "unsqueeze", "slice", "select")
MATMUL = ("mm", "bmm", "matmul")


def _ids(shape: Sequence[int], mult: int, n: int, device: torch.device) -> torch.Tensor:
    """Indices below `n` of `shape`, made from the positions (mult * i + 1, wrapped)."""
    return ((torch.arange(math.prod(shape), device=device) * mult + 1) % n).reshape(shape)


def apply_op(op: Op, args: Sequence[torch.Tensor]) -> torch.Tensor:
    """Run one op record (eager semantics; also traced by Dynamo)."""
    name, p = op.op, op.params
    x = args[0]
    if name == "where_s":  # where(x cmp s, x, fill)
        return torch.where(_CMP[p[0]](x, p[1]), x, p[2])
    if name in UNARY or name == "log":
        return _unary(name, x, p)
    if name in SCALAR:
        return _scalar(name, x, p[0])
    if name in BINARY or name in MATMUL:
        return _binary(name, x, args[1], p)
    if name in REDUCE:
        dims, keepdim = p
        fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}[name]
        if dims is None:
            return fn(x)
        return fn(x, dim=dims, keepdim=keepdim)
    if name == "softmax":
        return torch.softmax(x, dim=-1)
    if name == "log_softmax":
        return torch.log_softmax(x, dim=-1)
    if name == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), eps=p[0])
    if name == "cross_entropy":  # rows of the last dim; targets from the row positions,
        rows = x.reshape(-1, x.shape[-1])  # every third row ignored (-100)
        pos = torch.arange(rows.shape[0], device=x.device)
        target = torch.where(pos % 3 == 1, -100, (pos * 7) % rows.shape[1])
        return F.cross_entropy(rows, target, ignore_index=-100, reduction=p[0])
    if name == "embedding":  # rows of a 2-d table by ids made from positions
        ids_shape, mult = p
        return F.embedding(_ids(ids_shape, mult, x.shape[0], x.device), x)
    if name == "nan_guard":  # kl_div's mask: isnan / isinf inside kernels
        return torch.where(torch.isnan(x) | torch.isinf(x), torch.zeros_like(x), x)
    if name == "gather":  # an index of x's sizes off `dim`: a take (gathers.yaml)
        dim, k, mult = p
        shape = list(x.shape)
        shape[dim] = k
        return torch.gather(x, dim, _ids(shape, mult, x.shape[dim], x.device))
    if name == "set_first":  # a 0-d value written into column 0 (T5's shifted labels)
        y = x.clone()
        y.select(-1, 0).copy_(x.reshape(-1)[p[0] % x.numel()])
        return y
    if name == "batch_norm":  # training: the batch's statistics per channel (dim 1)
        return F.batch_norm(x, None, None, training=True, eps=p[0])
    if name == "transpose":
        return x.transpose(p[0], p[1])
    if name == "permute":
        return x.permute(*p)
    if name == "reshape":
        return x.reshape(p)
    if name == "view":
        return x.view(p)
    if name == "expand":
        return x.expand(*p)
    if name == "unsqueeze":
        return x.unsqueeze(p[0])
    if name == "slice":
        dim, start, stop, step = p
        idx = (slice(None),) * dim + (slice(start, stop, step),)
        return x[idx]
    if name == "select":
        return x.select(p[0], p[1])
    if name == "sdpa":
        return F.scaled_dot_product_attention(x, args[1], args[2], is_causal=p[0])
    if name == "conv2d":
        stride, padding, dilation, groups = p
        bias = args[2] if len(args) > 2 else None
        return F.conv2d(x, args[1], bias, stride=stride, padding=padding, dilation=dilation,
                        groups=groups)
    raise KeyError(name)


# --------------------------------------------------------------------------- building
def make_input(stmt: Input, seed: int, dtype: torch.dtype | None = None,
               requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, argument): the leaf holds the storage, the argument is the view
    of it with the requested layout. `dtype` overrides the statement's dtype
    (the float64 reference run)."""
    shape = tuple(stmt.shape)
    integer = stmt.dtype in INT_DTYPES
    dt = DTYPES[stmt.dtype] if integer or dtype is None else dtype
    layout = stmt.layout
    base_shape = list(shape)
    if layout == "t" and len(shape) >= 2:
        base_shape[-1], base_shape[-2] = shape[-2], shape[-1]
    elif layout == "step" and len(shape) >= 1:
        base_shape[-1] = 2 * shape[-1]
    elif layout == "offset" and len(shape) >= 1:
        base_shape[0] = shape[0] + 1
    elif layout == "expand" and any(s > 1 for s in shape):
        d = next(i for i, s in enumerate(shape) if s > 1)
        base_shape[d] = 1
    else:
        layout = "contig"
    gen = torch.Generator().manual_seed(1000 + seed)
    if stmt.values == "rand":
        base = torch.rand(base_shape, generator=gen, dtype=torch.float64)
    elif stmt.values == "fill":
        base = torch.full(base_shape, 0.1, dtype=torch.float64)
    else:
        base = torch.randn(base_shape, generator=gen, dtype=torch.float64)
    if integer:
        base = (base * 50).round()
    if stmt.values == "special" and base.numel():
        flat = base.view(-1)
        if integer:
            ii = torch.iinfo(dt)
            specials = torch.tensor([ii.min, ii.max, 0, -1], dtype=torch.float64)
        else:
            specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0],
                                    dtype=torch.float64)
        pick = torch.randint(0, 4, flat.shape, generator=gen) == 0
        which = torch.randint(0, len(specials), flat.shape, generator=gen)
        flat[pick] = specials[which[pick]]
    base = base.to(dt) if not integer else base.to(torch.int64).to(dt)
    if requires_grad and dt.is_floating_point:
        base.requires_grad_(True)
    if layout == "t":
        arg = base.transpose(-1, -2)
    elif layout == "step":
        arg = base[..., ::2]
    elif layout == "offset":
        arg = base[1:]
    elif layout == "expand":
        arg = base.expand(shape)
    else:
        arg = base
    assert tuple(arg.shape) == shape, (stmt, arg.shape)
    return base, arg


def build_fn(graph: Graph) -> Callable[..., Any]:
    """The program as a Python function of its inputs (in statement order)."""
    stmts = graph.stmts
    outs = graph.output_ids()
    input_ids = [i for i, _ in graph.inputs()]

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals: dict[int, torch.Tensor] = dict(zip(input_ids, xs, strict=True))
        for i, s in enumerate(stmts):
            if isinstance(s, Op):
                vals[i] = apply_op(s, [vals[a] for a in s.args])
        return tuple(vals[o] for o in outs)

    return fn


def make_args(graph: Graph, *, dtype: torch.dtype | None = None,
              requires_grad: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    leaves, args = [], []
    for i, s in graph.inputs():
        leaf, arg = make_input(s, i, dtype, requires_grad)
        leaves.append(leaf)
        args.append(arg)
    return leaves, args


def least_precise(graph: Graph) -> str:
    names = {s.dtype for _, s in graph.inputs()}
    names |= {s.params[0] for s in graph.ops() if s.op == "cast"}
    if graph.autocast is not None:
        names.add(graph.autocast)
    ints = names & set(INT_DTYPES)
    if ints and names - ints:
        # an op of integers gives torch's default float dtype (log of an i64 is f32)
        # whatever float the program casts it to after: f32's rounding, at least
        names.add("f32")
    if names - set(INT_DTYPES):  # a float result: its rounding, not integer exactness
        names -= set(INT_DTYPES)
    return max(names, key=_PRECISION.index)


def _tolerance_of(value: torch.Tensor, tols: dict[str, float]) -> dict[str, float]:
    """A value's tolerance: the program's (`least_precise`), but a floating value of a
    program of integers only (`sqrt(abs(x))` of an int32 x) is rounded as its dtype is."""
    if tols["atol"] == 0.0 and value.is_floating_point():
        return TOLERANCES.get(DTYPE_NAMES.get(value.dtype, "f32"), TOLERANCES["f32"])
    return tols


# --------------------------------------------------------------------------- checking
class FuzzFailure(AssertionError):
    pass


def _cotangents(outs: Sequence[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


def _compare(actual: torch.Tensor, expected: torch.Tensor, ref: torch.Tensor | None,
             tols: dict[str, float], what: str) -> None:
    """actual (compiled) vs expected (eager); ref: the float64 run, or None."""
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True, **tols)
        return
    except AssertionError as e:
        first = e
    if ref is None or actual.shape != expected.shape or actual.dtype != expected.dtype \
            or not expected.dtype.is_floating_point:
        raise FuzzFailure(f"{what}: {first}") from None
    a, x, r = actual.double(), expected.double(), ref.detach().double()
    if r.shape != a.shape:
        raise FuzzFailure(f"{what}: {first}") from None
    fin_a, fin_x = torch.isfinite(a), torch.isfinite(x)
    # Non-finite values must agree exactly (an overflow both sides hit is fine).
    same_special = torch.equal(fin_a, fin_x) and torch.equal(
        torch.where(fin_a, 0.0, a).nan_to_num(nan=7.0),
        torch.where(fin_x, 0.0, x).nan_to_num(nan=7.0))
    if same_special:
        m = fin_a & torch.isfinite(r)
        scale = tols["atol"] + tols["rtol"] * r[m].abs()
        err_a = ((a[m] - r[m]).abs() / scale).max().item() if m.any() else 0.0
        err_x = ((x[m] - r[m]).abs() / scale).max().item() if m.any() else 0.0
        if err_a <= REF_SLACK * err_x + 1.0:
            return
        raise FuzzFailure(f"{what}: {first}\nagainst the float64 run: compiled error "
                          f"{err_a:.3g}, eager error {err_x:.3g} (in tolerances)") from None
    raise FuzzFailure(f"{what}: {first}") from None


class _Program(torch.nn.Module):
    """The program as a module: the inputs listed in `graph.params` are its
    parameters (so inference graphs freeze them), the others its arguments."""

    def __init__(self, graph: Graph, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.fn = build_fn(graph)
        self.n_inputs = len(graph.inputs())
        self.param_pos = [k for k, (i, _) in enumerate(graph.inputs()) if i in graph.params]
        self.ps = torch.nn.ParameterList(params)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it, ps = iter(xs), iter(self.ps)
        full = [next(ps) if k in self.param_pos else next(it) for k in range(self.n_inputs)]
        return self.fn(*full)


class _Instance(NamedTuple):
    fn: Callable[..., Any]  # the function or module to call
    args: list[torch.Tensor]  # what to call it with
    leaves: list[torch.Tensor]  # whose .grad to compare: input leaves, then parameters
    params: list[torch.nn.Parameter]


def instantiate(graph: Graph, dtype: torch.dtype | None = None) -> _Instance:
    leaves, args = make_args(graph, dtype=dtype, requires_grad=graph.grad)
    if not graph.params:
        return _Instance(build_fn(graph), args, leaves, [])
    ids = [i for i, _ in graph.inputs()]
    params = [torch.nn.Parameter(a.detach(), requires_grad=graph.grad and a.is_floating_point())
              for i, a in zip(ids, args, strict=True) if i in graph.params]
    keep = [k for k, i in enumerate(ids) if i not in graph.params]
    return _Instance(_Program(graph, params), [args[k] for k in keep],
                     [leaves[k] for k in keep] + params, params)


def _update_params(inst: _Instance, step: int) -> None:
    """The same in-place update for eager's and compiled's parameters (an optimizer step)."""
    gen = torch.Generator().manual_seed(500 + step)
    with torch.no_grad():
        for p in inst.params:
            step = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
            p.add_(step.to(p.dtype) if p.is_floating_point() else step.round().to(p.dtype))
            p.grad = None


def _aliasing(outs: Sequence[torch.Tensor], args: Sequence[torch.Tensor]) -> set[tuple[int, int]]:
    """Which outputs share memory with another output (i, j) or with an input (i, -k-1):
    an in-place update of one would show in the other."""
    def ptr(t: torch.Tensor) -> int | None:
        return t.untyped_storage().data_ptr() if t.numel() else None

    pairs = set()
    for i, o in enumerate(outs):
        p = ptr(o)
        if p is None:
            continue
        pairs |= {(i, j) for j in range(i + 1, len(outs)) if ptr(outs[j]) == p}
        pairs |= {(i, -k - 1) for k, a in enumerate(args) if ptr(a) == p}
    return pairs


def _zero_signs(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Where both are zero, the signs agree: 1 / x tells -0.0 from 0.0."""
    if not expected.dtype.is_floating_point or actual.shape != expected.shape:
        return
    zeros = (actual == 0) & (expected == 0)
    if not torch.equal(actual.signbit()[zeros], expected.signbit()[zeros]):
        i = int((zeros & (actual.signbit() != expected.signbit())).nonzero()[0].sum())
        raise FuzzFailure(f"{what}: the sign of a zero differs from eager's "
                          f"(compiled {actual.reshape(-1)[i].item()!r} at a zero eager gives "
                          f"as {expected.reshape(-1)[i].item()!r})")


def _autocast(graph: Graph) -> Any:
    if graph.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", DTYPES[graph.autocast])


def _run(inst: _Instance, grads: list[torch.Tensor] | None) -> tuple[Any, list[Any]]:
    for leaf in inst.leaves:
        leaf.grad = None
    outs = inst.fn(*inst.args)
    if grads is not None:
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    return outs, [leaf.grad for leaf in inst.leaves]


def _run_ref(graph: Graph, step: int, grads: list[torch.Tensor] | None
             ) -> tuple[Any, list[Any] | None]:
    """The program on float64 inputs (casts inside it still round)."""
    try:
        inst = instantiate(graph, dtype=torch.float64)
        for k in range(step):
            _update_params(inst, k)
        outs, gl = _run(inst, grads)
        return outs, gl if grads is not None else None
    except Exception:  # noqa: BLE001 - e.g. mm of a float64 and a cast bfloat16 value
        return None, None


STATS: Counter[str] = Counter()

# Failures already minimized into tests/regressions/test_fuzz_regressions.py
# (xfail there, strict) and not fixed yet. `check_property` skips examples that
# fail this way, so the fuzz keeps looking for new bugs; delete an entry when
# its regression test starts passing. name -> (regex over "Type: message",
# condition on (graph, options) or None).
KNOWN_FAILURES: dict[str, tuple[str, Callable[[Graph, dict[str, Any]], bool] | None]] = {
    # test_one_minus_sin_squared_*
    "one-minus-sin-squared-cancellation": (
        r"FuzzFailure: .*Tensor-likes are not close!",
        lambda g, o: {"sin", "pow", "rsub_s"} <= {op.op for op in g.ops()}),
    # test_gelu_of_inf_in_kernels
    "gelu-kernel-of-inf": (
        r"FuzzFailure: .*Tensor-likes are not close!.*difference: nan",
        lambda g, o: o.get("target") != "aten" and any(op.op == "gelu" for op in g.ops())
        and any(s.values == "special" for _, s in g.inputs())),
    # test_bfloat16_store_rounds_to_nearest_in_triton (broad: any bfloat16 mismatch there)
    "triton-interpreter-truncates-bfloat16": (
        r"FuzzFailure: .*Tensor-likes are not close!",
        lambda g, o: o.get("target") == "triton" and least_precise(g) == "bf16"),
    # test_fp_contract.py: test_layer_norm_near_overflow. A row whose variance overflows
    # f32 (exp of an int8 input reaches 1e23, its square inf) is nan in rewritec and
    # often 0 in eager (its Welford steps stay finite), both far from the f64 answer
    "layer-norm-variance-overflow": (
        r"FuzzFailure: .*Tensor-likes are not close!.*difference: nan",
        lambda g, o: any(op.op == "layer_norm" for op in g.ops())),
    # test_layout.py: test_nonfinite_weights_over_zero_padding_follow_the_nhwc_convolution.
    # An inf weight over zero padding: nan in ATen's NCHW convolution, not in the NHWC
    # one the layout pass runs (seed 14)
    "conv-nonfinite-weight-over-padding": (
        r"FuzzFailure: .*Tensor-likes are not close!.*difference: nan",
        lambda g, o: o.get("target") != "aten" and any(op.op == "conv2d" for op in g.ops())
        and any(s.values == "special" for _, s in g.inputs())),
    # test_layer_norm_of_a_constant_row
    "layer-norm-decomposition-on-a-constant-row": (
        r"FuzzFailure: .*Tensor-likes are not close!",
        lambda g, o: any(op.op == "layer_norm" for op in g.ops()) and any(
            s.layout == "expand" for _, s in g.inputs())),
}


def known_failure(e: BaseException, graph: Graph | None = None,
                  options: dict[str, Any] | None = None) -> str | None:
    text = f"{type(e).__name__}: {e}"
    for name, (pattern, condition) in KNOWN_FAILURES.items():
        if re.search(pattern, text, re.DOTALL) and (
                condition is None or graph is None or condition(graph, options or {})):
            return name
    return None


def check_property(graph: Graph, options: dict[str, Any]) -> None:
    """`check_graph`, with examples that hit a known (regression-tested) failure rejected."""
    try:
        check_graph(graph, options)
    except Exception as e:
        name = known_failure(e, graph, options)
        if name is None:
            raise
        STATS["known failure: " + name] += 1
        reject()


def check_graph(graph: Graph, options: dict[str, Any], **extra: Any) -> None:
    """Compile `graph` strictly with `options`; outputs (and gradients) == eager.

    A graph with parameters runs twice, with an in-place update of the
    parameters in between: a compilation that froze them must notice.
    """
    torch._dynamo.reset()
    STATS["examples"] += 1
    STATS["grad" if graph.grad else "forward"] += 1
    if graph.params:
        STATS["with parameters"] += 1
    for op in graph.ops():
        STATS["op:" + op.op] += 1
    tols = TOLERANCES[least_precise(graph)]
    start = len(report.RECORDS)
    eager, mine = instantiate(graph), instantiate(graph)
    if graph.params:
        extra.setdefault("freeze", True)  # the guard against parameter updates is tested too
    compiled = rewritec.compile(mine.fn, strict=True, **options, **extra)
    check_zero_signs = not graph.grad and not any(op.op in SIGNED_ZERO_FREE
                                                  for op in graph.ops())
    for step in range(2 if graph.params else 1):
        if step:
            _update_params(eager, step - 1)
            _update_params(mine, step - 1)
        grads = None
        if graph.grad:
            with torch.no_grad(), _autocast(graph):
                grads = _cotangents(eager.fn(*eager.args))
        with _autocast(graph):
            out_e, grads_e = _run(eager, grads)
        with warnings.catch_warnings(), _autocast(graph):
            warnings.simplefilter("error", RewritecWarning)
            out_c, grads_c = _run(mine._replace(fn=compiled), grads)
        records = report.RECORDS[start:]
        assert records, "no graph reached rewritec"
        bad = [(r.name, r.reason) for r in records if r.status != "compiled"]
        assert not bad, f"fell back: {bad}"
        if not isinstance(out_c, tuple) or len(out_c) != len(out_e):
            raise FuzzFailure(f"compiled returned {type(out_c)}, eager {len(out_e)} outputs")
        if graph.grad and [o.requires_grad for o in out_c] != [o.requires_grad for o in out_e]:
            raise FuzzFailure("compiled outputs differ from eager in requires_grad")
        extra = _aliasing(out_c, mine.args) - _aliasing(out_e, eager.args)
        for i, j in sorted(extra, key=lambda p: p[1] >= 0):  # output-input pairs first
            if j < 0:
                raise FuzzFailure(f"compiled output {i} shares memory with input {-j - 1}; "
                                  f"eager's does not")
            raise FuzzFailure(f"compiled outputs {i} and {j} share memory; eager's do not")
        n_args = len(mine.args)
        what = [f"output {i}" for i in range(len(out_e))] + \
            [f"grad of parameter {k - n_args}" if k >= n_args else f"grad of input {k}"
             for k in range(len(grads_e))]
        if step:
            what = [f"{w} after a parameter update" for w in what]
        got, want = list(out_c) + list(grads_c), list(out_e) + list(grads_e)
        needs_ref = False
        for w, c, e in zip(what, got, want, strict=True):
            if (c is None) != (e is None):
                raise FuzzFailure(f"{w}: compiled {c is None=}, eager {e is None=}")
            if e is not None:
                if check_zero_signs:
                    _zero_signs(c, e, w)
                try:
                    _compare(c, e, None, _tolerance_of(e, tols), w)
                except FuzzFailure:
                    needs_ref = True
        if needs_ref:
            STATS["needed float64 reference"] += 1
            ref_out, ref_grads = _run_ref(graph, step, grads)
            refs: list[Any] = [None] * len(want)
            if ref_out is not None:
                refs = list(ref_out) + list(ref_grads or [None] * len(grads_e))
            for w, c, e, r in zip(what, got, want, refs, strict=True):
                if e is not None:
                    _compare(c, e, r, _tolerance_of(e, tols), w)
    for r in report.RECORDS[start:]:
        for rule, k in r.rules_fired.items():
            STATS["rule: " + rule] += k
        STATS["kernels"] += len(r.kernels)


# --------------------------------------------------------------------------- strategy
SIZES = (1, 2, 3, 5, 7, 4, 11, 13, 8, 16)  # 1, small primes, 7, powers of two
MAX_NUMEL = 4096
SCALARS = (2.0, 1.0, 0.0, -0.5, 1, 0, 3, 0.1)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@st.composite
def _shape(draw: Any, min_rank: int = 0, max_rank: int = 4) -> tuple[int, ...]:
    rank = draw(st.integers(min_rank, max_rank))
    shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(rank))
    while _numel(shape) > MAX_NUMEL // 4:
        shape = shape[1:]
    return shape


@st.composite
def _input(draw: Any, shape: tuple[int, ...], dtype: str | None = None) -> Input:
    dt = dtype or draw(st.sampled_from(["f32", "f32", "f64", "bf16", "f16", "int"]))
    if dt == "int":
        dt = draw(st.sampled_from(INT_DTYPES))
    layouts = ["contig"]
    if len(shape) >= 2:
        layouts.append("t")
    if len(shape) >= 1:
        layouts += ["step", "offset"]
    if any(s > 1 for s in shape):
        layouts.append("expand")
    layout = draw(st.sampled_from(layouts))
    values = draw(st.sampled_from(["randn"] * 6 + ["rand", "special"]))
    return Input(shape, dt, layout, values)


@st.composite
def _partner_shape(draw: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape` (either way)."""
    out = []
    for s in shape:
        choice = draw(st.sampled_from(["same", "same", "one"] + (["grow"] if s == 1 else [])))
        out.append(s if choice == "same" else 1 if choice == "one" else
                   draw(st.sampled_from(SIZES[1:6])))
    out_t = tuple(out)
    if out_t and draw(st.booleans()):
        out_t = out_t[draw(st.integers(1, len(out_t))):]  # fewer leading dims
    elif len(out_t) < 4 and draw(st.integers(0, 3)) == 0:
        out_t = (draw(st.sampled_from(SIZES[:5])),) + out_t  # one more leading dim
    return out_t


def _factor(n: int) -> list[int]:
    fs, p = [], 2
    while p * p <= n:
        while n % p == 0:
            fs.append(p)
            n //= p
        p += 1
    if n > 1:
        fs.append(n)
    return fs


@st.composite
def _reshape_target(draw: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    n = _numel(shape)
    fs = draw(st.permutations(_factor(n))) if n > 1 else []
    rank = draw(st.integers(0 if n == 1 else 1, 4))
    dims = [1] * max(rank, 1)
    for f in fs:
        dims[draw(st.integers(0, len(dims) - 1))] *= f
    if rank == 0:
        return ()
    out = tuple(dims)
    if len(out) > 1 and draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(out) - 1))
        out = out[:i] + (-1,) + out[i + 1:]
    return out


class _Builder:
    """The program being drawn, with a real tensor for every statement."""

    def __init__(self) -> None:
        self.stmts: list[Input | Op] = []
        self.vals: list[torch.Tensor] = []

    def add_input(self, stmt: Input) -> int:
        _, arg = make_input(stmt, len(self.stmts))
        self.stmts.append(stmt)
        self.vals.append(arg)
        return len(self.stmts) - 1

    def try_op(self, op: Op, limit: bool = True) -> bool:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                v = apply_op(op, [self.vals[a] for a in op.args])
        except (RuntimeError, ValueError, IndexError, TypeError):
            return False
        if not isinstance(v, torch.Tensor) or (limit and v.numel() > MAX_NUMEL):
            return False
        self.stmts.append(op)
        self.vals.append(v)
        return True


def _op_kinds(x: torch.Tensor, allow_conv: bool, computed: bool) -> list[str]:
    r = x.dim()
    kinds = list(UNARY) + list(SCALAR) + list(BINARY) + ["where_s"] + list(REDUCE)
    if computed and x.dtype in (torch.float16, torch.bfloat16):
        # A comparison of a computed half-precision value flips on a one-ulp rounding
        # difference (a decomposition, a kernel computing in float32): a false alarm.
        kinds = [k for k in kinds if k not in ("where", "where_s")]
    if r >= 1:
        kinds += list(LASTDIM) + ["transpose", "permute", "slice", "select"]
    if r >= 2 and x.is_floating_point():
        kinds.append("batch_norm")
    if r >= 1 and x.is_floating_point():
        kinds.append("cross_entropy")  # an integer comparison inside its row kernels
    if r == 2 and x.is_floating_point():
        kinds.append("embedding")  # a take: rows read by id (rules/decompose/gathers.yaml)
    if r >= 1 and x.numel() > 0:
        kinds += ["gather", "set_first"]
    kinds.append("nan_guard")
    kinds += ["reshape", "view", "expand", "unsqueeze"]
    if r >= 1:
        kinds.append("matmul")
    if r == 2:
        kinds.append("mm")
    if r == 3:
        kinds.append("bmm")
    if r == 4 and allow_conv:
        kinds.append("conv2d")
    if r == 4 and x.is_floating_point():
        kinds.append("sdpa")
    return kinds


def _channel_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """Ones except `shape[dim]`: a per-channel (dim 1) or per-column (dim -1) operand."""
    out = [1] * len(shape)
    out[dim] = shape[dim]
    return tuple(out)


@st.composite
def _op(draw: Any, b: _Builder, allow_conv: bool, kind: str | None = None,
        params: tuple[Any, ...] | None = None, ai: int | None = None,
        partner: str | None = None) -> bool:
    """Draw one op on an earlier value and append it (and any fresh operand).

    A motif forces `kind`, `params`, the operand `ai` and, for binary ops, the
    `partner`: "self", "channel" (ones but dim 1) or "column" (ones but the last
    dim). Returns whether the drawn op itself (not a stand-in) was appended.
    """
    n = len(b.stmts)
    if ai is None:
        # Prefer recent values, so programs are chains more than stars.
        ai = n - 1 - draw(st.integers(0, n - 1))
    x = b.vals[ai]
    shape, r = tuple(x.shape), x.dim()
    dtname = DTYPE_NAMES.get(x.dtype, "f32")
    if kind is None:
        kind = draw(st.sampled_from(_op_kinds(x, allow_conv, isinstance(b.stmts[ai], Op))))
    p: tuple[Any, ...] = ()
    args: tuple[int, ...] = (ai,)

    def other(partner_shape: tuple[int, ...], dtype: str | None) -> int:
        """An earlier value of this shape (and dtype) or a fresh input."""
        cands = [i for i, v in enumerate(b.vals) if tuple(v.shape) == partner_shape
                 and (dtype is None or DTYPE_NAMES.get(v.dtype) == dtype)]
        if cands and draw(st.booleans()):
            return draw(st.sampled_from(cands))
        return b.add_input(draw(_input(partner_shape, dtype)))

    if kind == "gelu":
        p = (draw(st.sampled_from(["none", "tanh"])),)
    elif kind == "clamp":
        lo = draw(st.sampled_from([None, -1.0, 0.0, -0.5]))
        hi = draw(st.sampled_from([1.0, None, 0.5, 2.0]))
        if lo is None and hi is None:
            hi = 1.0
        p = (lo, hi)
    elif kind == "pow":
        p = (draw(st.sampled_from([2, 3, 1, 0, 4, 2.0, 0.5, -1])),)
    elif kind == "cast":
        p = (draw(st.sampled_from(["f32", "f64", "bf16", "f16"])),)
    elif kind in SCALAR:
        p = (draw(st.sampled_from(SCALARS)),)
    elif kind == "where_s":
        p = (draw(st.sampled_from(list(_CMP))), draw(st.sampled_from([0.0, 0.5, -1.0])),
             draw(st.sampled_from([0.0, -1.0, 2.0])))
    elif kind in BINARY:
        if kind in ("add", "sub"):
            p = (draw(st.sampled_from([1, 2, -0.5])),)
        elif kind == "clamp_t":
            p = (draw(st.sampled_from(["min", "max"])),)
        elif kind == "where":
            p = (draw(st.sampled_from(list(_CMP))),)
        how = partner or draw(st.sampled_from(["partner", "partner", "self"]))
        if how == "self":
            j = ai
        elif how in ("channel", "column") and r >= (2 if how == "channel" else 1):
            cshape = _channel_shape(shape, 1 if how == "channel" else -1)
            j = other(cshape[draw(st.integers(0, 1 if how == "channel" else r - 1)):], dtname)
        else:
            j = other(draw(_partner_shape(shape)), None)
        args = (ai, j) if partner or draw(st.booleans()) else (j, ai)
    elif kind in REDUCE:
        if r == 0 or draw(st.integers(0, 4)) == 0:
            p = (None, False)
        else:
            dims = draw(st.lists(st.integers(-r, r - 1), min_size=1, max_size=r,
                                 unique_by=lambda d: d % r))
            p = (tuple(dims), draw(st.booleans()))
    elif kind in ("layer_norm", "batch_norm"):
        p = (draw(st.sampled_from([1e-5, 1e-3])),)
    elif kind == "cross_entropy":
        p = (draw(st.sampled_from(["mean", "sum", "none"])),)
    elif kind == "embedding":
        p = (draw(st.sampled_from([(3,), (2, 5), (1, 4, 3)])), draw(st.sampled_from([1, 3, 7])))
    elif kind == "gather":
        p = (draw(st.integers(0, r - 1)), draw(st.sampled_from([1, 2, 3])),
             draw(st.sampled_from([1, 3, 7])))
    elif kind == "set_first":
        p = (draw(st.integers(0, 5)),)
    elif kind == "transpose":
        p = (draw(st.integers(-r, r - 1)), draw(st.integers(-r, r - 1)))
    elif kind == "permute":
        p = tuple(draw(st.permutations(range(r))))
    elif kind in ("reshape", "view"):
        p = draw(_reshape_target(shape))
    elif kind == "expand":
        target = []
        for s in shape:
            target.append(draw(st.sampled_from(SIZES[1:6])) if s == 1 and draw(st.booleans())
                          else draw(st.sampled_from([s, -1])))
        if len(target) < 4 and (not target or draw(st.booleans())):
            target.insert(0, draw(st.sampled_from(SIZES[:5])))
        p = tuple(target)
    elif kind == "unsqueeze":
        p = (draw(st.integers(-r - 1, r)),)
    elif kind == "slice":
        d = draw(st.integers(0, r - 1))
        size = shape[d]
        start = draw(st.integers(0, max(size - 1, 0)))
        stop = draw(st.sampled_from([None, size, max(start + 1, size - 1)]))
        p = (d, start, stop, draw(st.sampled_from([1, 2, 3])))
    elif kind == "select":
        d = draw(st.integers(0, r - 1))
        p = (d, draw(st.integers(-shape[d], shape[d] - 1)))
    elif kind == "mm":
        k = shape[1]
        args = (ai, other((k, draw(st.sampled_from(SIZES))), dtname))
    elif kind == "bmm":
        args = (ai, other((shape[0], shape[2], draw(st.sampled_from(SIZES))), dtname))
    elif kind == "matmul":
        k = shape[-1]
        form = draw(st.sampled_from(["mat", "vec", "batched"]))
        if form == "vec":
            pshape: tuple[int, ...] = (k,)
        elif form == "mat":
            pshape = (k, draw(st.sampled_from(SIZES)))
        else:
            batch = draw(_partner_shape(shape[:-2])) if r > 2 else \
                (draw(st.sampled_from(SIZES[:5])),)
            pshape = batch + (k, draw(st.sampled_from(SIZES)))
        args = (ai, other(pshape, dtname))
    elif kind == "sdpa":  # self- or cross-attention: keys and values of another length
        kv = shape[:2] + (draw(st.sampled_from([shape[2], *SIZES[1:5]])), shape[3])
        args = (ai, other(kv, dtname), other(kv, dtname))
        p = (draw(st.booleans()),)
    elif kind == "conv2d":
        c = shape[1]
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
        cout = groups * draw(st.integers(1, 3))
        stride, pad, dil = draw(st.integers(1, 2)), draw(st.integers(0, 1)), draw(st.integers(1, 2))
        # The dilated kernel must fit in the padded input.
        kh = draw(st.integers(1, max(1, min(3, (shape[2] + 2 * pad - 1) // dil + 1))))
        kw = draw(st.integers(1, max(1, min(3, (shape[3] + 2 * pad - 1) // dil + 1))))
        p = (stride, pad, dil, groups)
        w = other((cout, c // groups, kh, kw), dtname)
        args = (ai, w)
        if draw(st.booleans()):
            args += (other((cout,), dtname),)
    if params is not None:
        p = params
    op = Op(kind, args, p)
    if b.try_op(op):
        return True
    # view needs compatible strides; reshape never does
    if kind == "view" and b.try_op(Op("reshape", args, p)):
        return True
    # An invalid draw (e.g. conv kernel larger than the padded input): a neutral op.
    ok = b.try_op(Op("neg", (ai,)), limit=False)
    assert ok
    return False


# Short op sequences that some rewrite rule (rules/) matches, with the
# operands that rule's guards must tell apart: `(kind, params, partner)` steps,
# each applied to the previous step's result. None: drawn as usual.
MOTIFS: dict[str, list[tuple[str, Any, str | None]]] = {
    "conv-affine": [("conv2d", None, None), ("mul", (), "channel"), ("add", (1,), "channel")],
    "linear-affine": [("matmul", None, None), ("add", (1,), "column"), ("mul", (), "column"),
                      ("add", (1,), "column")],
    "mm-affine": [("mm", None, None), ("mul", (), "column"), ("add", (1,), "column")],
    "affine-any": [("matmul", None, None), ("mul", (), None), ("add", (1,), None)],
    "one-minus-sigmoid": [("sigmoid", (), None), ("rsub_s", (1,), None)],
    "sigmoid-to-tanh": [("mul_s", (2,), None), ("sigmoid", (), None), ("mul_s", (2,), None),
                        ("sub_s", (1,), None)],
    "one-minus-sin-squared": [("sin", (), None), ("pow", (2,), None), ("rsub_s", (1,), None)],
    "exp-log": [("log", (), None), ("exp", (), None)],
    "exp-log-abs": [("log_abs1", (), None), ("exp", (), None)],
    "log-exp": [("exp", (), None), ("log", (), None)],
    "transpose-transpose": [("transpose", None, None), ("transpose", None, None)],
    "permute-permute": [("permute", None, None), ("permute", None, None)],
    "view-view": [("view", None, None), ("view", None, None)],
    "reshape-contiguous-view": [("transpose", None, None), ("contiguous", (), None),
                                ("view", None, None)],
    "cast-roundtrip": [("cast", None, None), ("cast", ("<start dtype>",), None)],
    # rules/simplify/sink_views.yaml: a transpose below the op that feeds its copy
    "add-transpose-copy": [("add", (1,), None), ("transpose", None, None),
                           ("contiguous", (), None)],
    "mul-transpose-copy": [("mul", (), None), ("transpose", None, None),
                           ("contiguous", (), None)],
    "sum-transpose-copy": [("sum", ((0,), False), None), ("transpose", None, None),
                           ("contiguous", (), None)],
    # rules/simplify/views.yaml: a view of a sum that kept its dim (a bias gradient)
    "keepdim-sum-view": [("sum", ((0,), True), None), ("view", None, None)],
    "relu-relu": [("relu", (), None), ("relu", (), None)],
    "relu-abs": [("abs", (), None), ("relu", (), None)],
    "tanh-neg": [("neg", (), None), ("tanh", (), None)],
    "neg-neg": [("neg", (), None), ("neg", (), None)],
    "mul-one": [("mul_s", (1,), None)],
    "mul-zero": [("mul_s", (0.0,), None)],
    "add-zero": [("add_s", (0,), None)],
    "div-one": [("div_s", (1.0,), None)],
    "sub-self": [("sub", (1,), "self")],
    "pow-half": [("pow", (0.5,), None)],
    "pow-two": [("pow", (2.0,), None)],
    # rules/decompose/activations.yaml, predicates.yaml, gathers.yaml, simplify/casts.yaml
    "clamp-row-bound": [("clamp_t", ("min",), "column"), ("clamp_t", ("max",), "channel")],
    "nan-guard-log": [("log", (), None), ("nan_guard", (), None)],
    "gather-rows": [("gather", None, None), ("mul_s", (2.0,), None)],
    "set-first-cast": [("set_first", None, None), ("cast", None, None)],
}


# The least rank of a motif's first operand where a later step needs more than the
# first does (a transpose after a sum over dim 0 needs rank 3)
MOTIF_RANKS = {"add-transpose-copy": 2, "mul-transpose-copy": 2, "sum-transpose-copy": 3,
               "keepdim-sum-view": 1, "clamp-row-bound": 2, "gather-rows": 1,
               "set-first-cast": 1}


@st.composite
def _motif(draw: Any, b: _Builder, allow_conv: bool) -> None:
    name = draw(st.sampled_from(sorted(MOTIFS)))
    steps = MOTIFS[name]
    first = steps[0][0]
    if first == "conv2d" and not allow_conv:
        return
    rank_ok = {"conv2d": lambda d: d == 4, "mm": lambda d: d == 2}.get(
        first, (lambda d: d >= 2) if first in ("transpose", "permute", "matmul")
        else (lambda d: True))
    if name in MOTIF_RANKS:  # what the later steps need of the first one's operand
        rank_ok = lambda d, least=MOTIF_RANKS[name]: d >= least  # noqa: E731
    cands = [i for i, v in enumerate(b.vals) if rank_ok(v.dim())]
    if cands:
        ai = draw(st.sampled_from(cands))
    else:
        shape = (draw(st.sampled_from(SIZES[:6])), draw(st.sampled_from(SIZES[:6])))
        if first == "conv2d":
            shape = (1, *shape, 5)
        ai = b.add_input(draw(_input(shape)))
    start_dtype = DTYPE_NAMES.get(b.vals[ai].dtype, "f32")
    for kind, params, partner in steps:
        if params == ("<start dtype>",):
            params = (start_dtype,)
        if not draw(_op(b, allow_conv, kind=kind, params=params, ai=ai, partner=partner)):
            return
        ai = len(b.stmts) - 1


@st.composite
def graphs(draw: Any, max_ops: int = 6, grad: bool | None = None,
           allow_conv: bool = True) -> Graph:
    """A random valid program: 1-2 inputs, 1..max_ops ops, fresh inputs drawn on demand."""
    b = _Builder()
    shape = draw(_shape())
    b.add_input(draw(_input(shape)))
    if draw(st.booleans()):
        b.add_input(draw(_input(draw(_partner_shape(shape)))))
    if allow_conv and draw(st.integers(0, 9)) == 0:  # conv and attention need 4-d values
        b.add_input(draw(_input(tuple(draw(st.sampled_from(SIZES[:6])) for _ in range(4)))))
    for _ in range(draw(st.integers(1, max_ops))):
        if draw(st.integers(0, 3)) == 0:
            draw(_motif(b, allow_conv))
        else:
            draw(_op(b, allow_conv))
    if not any(isinstance(s, Op) for s in b.stmts):
        # only motifs that could not start (a convolution's, allow_conv=False): a
        # program of inputs alone returns them, and TorchDynamo makes no graph of it
        draw(_op(b, allow_conv))
    g = grad if grad is not None else draw(st.booleans())
    params: tuple[int, ...] = ()
    if draw(st.integers(0, 2)) == 0:  # a module: some inputs are its parameters
        # (not expanded ones: the parameter update is in place)
        params = tuple(i for i, s in enumerate(b.stmts) if isinstance(s, Input)
                       and s.layout != "expand" and draw(st.booleans()))
    autocast = draw(st.sampled_from([None] * 6 + ["bf16", "f16"]))
    return Graph(tuple(b.stmts), grad=g, params=params, autocast=autocast)


# Reductions over millions of elements, where an accumulation that is not pairwise
# drifts from ATen's (CI affords a few: each input is a few MB).
LARGE_SHAPES = ((1 << 21,), (3, (1 << 20) + 7), ((1 << 18) + 3, 3), (1000, 2049))


@st.composite
def large_reductions(draw: Any) -> Graph:
    """One large input, perhaps a pointwise op, then a reduction over many elements."""
    b = _Builder()
    shape = draw(st.sampled_from(LARGE_SHAPES))
    dt = draw(st.sampled_from(["f32", "f32", "bf16", "f16", "f64"]))
    b.add_input(Input(shape, dt, "contig", draw(st.sampled_from(["fill", "rand", "randn"]))))
    if draw(st.booleans()):
        b.try_op(Op(draw(st.sampled_from(["abs", "sigmoid", "relu"])), (0,)), limit=False)
    last = len(b.stmts) - 1
    kind = draw(st.sampled_from(["sum", "sum", "mean", "amax", "softmax", "log_softmax",
                                 "layer_norm"]))
    if kind in REDUCE:
        dims = draw(st.sampled_from([None, (-1,), (0,)]))
        params: tuple[Any, ...] = (dims, draw(st.booleans())) if dims else (None, False)
    else:
        params = (1e-5,) if kind == "layer_norm" else ()
    assert b.try_op(Op(kind, (last,), params), limit=False)
    return Graph(tuple(b.stmts))


# --------------------------------------------------------------------------- shrinking
def failure_signature(e: BaseException) -> str:
    """What kind of failure, without the numbers: groups failures and guides shrinking."""
    lines = [ln for ln in str(e).strip().split("\n") if ln.strip()] or [""]
    msg = lines[0]
    if msg.startswith("backend=") and len(lines) > 1:  # Dynamo's wrapper: the cause is next
        msg = lines[1]
    msg = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", msg)
    return f"{type(e).__name__}: {msg[:160]}"


def is_valid(graph: Graph) -> bool:
    """Does eager PyTorch run the program (and its backward)?"""
    try:
        fn = build_fn(graph)
        _, args = make_args(graph, requires_grad=graph.grad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = fn(*args)
            if not outs or any(not isinstance(o, torch.Tensor) or o.numel() > 4 * MAX_NUMEL
                               for o in outs):
                return False
            if graph.grad:
                req = [o for o in outs if o.requires_grad]
                if not req:
                    return False
                torch.autograd.backward(req, [torch.ones_like(o) for o in req])
    except Exception:  # noqa: BLE001
        return False
    return True


def _without(graph: Graph, i: int, replacement: int | None) -> Graph:
    """Statement i removed; readers of it read `replacement` instead."""
    def renum(a: int) -> int:
        if a == i:
            assert replacement is not None
            a = replacement
        return a - 1 if a > i else a

    stmts = []
    for k, s in enumerate(graph.stmts):
        if k == i:
            continue
        if isinstance(s, Op):
            s = s._replace(args=tuple(renum(a) for a in s.args))
        stmts.append(s)
    outputs = None
    if graph.outputs is not None:
        outputs = tuple(dict.fromkeys(renum(o) for o in graph.outputs))
    params = tuple(renum(p) for p in graph.params if p != i)
    return graph._replace(stmts=tuple(stmts), outputs=outputs, params=params)


def _candidates(graph: Graph) -> list[Graph]:
    """Simpler variants of `graph`, simplest first."""
    out: list[Graph] = []
    n = len(graph.stmts)
    used = {a for s in graph.stmts if isinstance(s, Op) for a in s.args}
    if graph.grad:
        out.append(graph._replace(grad=False))
    if graph.params:
        out.append(graph._replace(params=()))
        out += [graph._replace(params=tuple(q for q in graph.params if q != p))
                for p in graph.params]
    # Return fewer values.
    outs = graph.output_ids()
    if len(outs) > 1:
        out += [graph._replace(outputs=(o,)) for o in outs]
    for i in reversed(range(n)):
        s = graph.stmts[i]
        if isinstance(s, Input) and i not in used:
            out.append(_without(graph, i, None))
        elif isinstance(s, Op):
            if i not in used and len(outs) > 1:
                out.append(_without(graph, i, None))
            for a in dict.fromkeys(s.args):  # bypass the op: readers read an operand
                out.append(_without(graph, i, a))
    for i, s in enumerate(graph.stmts):
        if isinstance(s, Input):
            for field, simple in (("values", "randn"), ("layout", "contig"), ("dtype", "f32")):
                if getattr(s, field) != simple:
                    stmts = list(graph.stmts)
                    stmts[i] = s._replace(**{field: simple})
                    out.append(graph._replace(stmts=tuple(stmts)))
            for size in s.shape:  # smaller sizes (all inputs with that size)
                for smaller in (1, 2, 3):
                    if smaller < size:
                        out.append(_resize(graph, size, smaller))
    return out


def _resize(graph: Graph, size: int, smaller: int) -> Graph:
    stmts = [s._replace(shape=tuple(smaller if d == size else d for d in s.shape))
             if isinstance(s, Input) else s for s in graph.stmts]
    return graph._replace(stmts=tuple(stmts))


def shrink(graph: Graph, still_fails: Callable[[Graph], bool], budget: int = 400) -> Graph:
    """Greedy shrinking: take the first simpler valid variant that still fails, repeat."""
    tried: set[Graph] = set()
    progress = True
    while progress and budget > 0:
        progress = False
        for cand in _candidates(graph):
            if cand in tried or budget <= 0:
                continue
            tried.add(cand)
            if not is_valid(cand):
                continue
            budget -= 1
            if still_fails(cand):
                graph = cand
                progress = True
                break
    if graph.outputs is not None and graph.outputs == Graph(graph.stmts).output_ids():
        graph = graph._replace(outputs=None)
    return graph


def fails_like(signature: str, options: dict[str, Any]) -> Callable[[Graph], bool]:
    def still_fails(g: Graph) -> bool:
        try:
            check_graph(g, options)
        except Exception as e:  # noqa: BLE001
            return failure_signature(e) == signature
        return False

    return still_fails
