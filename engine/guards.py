"""Guards: the `where:` conditions of a rule, interpreted over the AST.

Guards are parsed by the same grammar as patterns and evaluated here by a
small interpreter with a fixed table of functions; rule text never reaches
`eval`. A guard that cannot be decided (a symbolic size, a missing value)
counts as false, so an undecided guard never lets a rewrite through.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import syntax as S
from .arith import ARITH
from .term import Term

DTYPE_NAMES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "b8")
FLOAT_DTYPES = ("f64", "f32", "f16", "bf16")


class Undecided(Exception):
    """The guard's value is not known at compile time."""


@dataclass
class GuardContext:
    """What guards may ask about the graph beyond a term's own metadata."""

    users: Callable[[Term], int]
    is_frozen: Callable[[Term], bool]
    # the op category of each reader of a term ("output" for a graph output), for
    # `pointwise_users`; where unknown, the guard is undecided (false)
    user_categories: Callable[[Term], list[str]] = field(default=lambda t: _unknown(t))
    # the op table's category of a term's op ("pointwise", "view", ...), for `computed`
    category: Callable[[Term], str] = field(default=lambda t: _unknown_category(t))


def _unknown(t: Term) -> list[str]:
    raise Undecided("the graph's readers are not known here")


def _unknown_category(t: Term) -> str:
    raise Undecided("the op table is not known here")


# What a kernel computes: values of these categories (engine/ops.py), not inputs,
# views of them or library calls
COMPUTED = ("pointwise", "reduction", "indexed")


def _tensor(t: Any) -> Term:
    if not isinstance(t, Term):
        raise Undecided(f"{t!r} is not a term")
    return t


def _const_value(t: Term) -> Any:
    if t.op != "const":
        raise Undecided("not a constant")
    return t.value


NONNEG_OPS = ("exp", "sigmoid", "relu", "abs", "sqrt", "softmax", "ones_like", "zeros_like")


def _nonneg(t: Any) -> bool:
    """True when `t` is >= 0 (or nan) by construction; false when unknown."""
    t = _tensor(t)
    if t.op in NONNEG_OPS:
        return True
    if t.op == "const":
        return isinstance(t.value, int | float) and t.value >= 0
    if t.op == "mul" and len(t.args) == 2 and t.args[0] is t.args[1]:
        return True
    if t.op in ("mul", "add", "div") and len(t.args) == 2 and t.attr("alpha", 1) == 1:
        return all(_nonneg(a) for a in t.args)
    return False


# (narrow, wide): converting narrow -> wide -> narrow gives back every value.
EXACT_WIDENING = {
    ("f16", "f32"), ("bf16", "f32"), ("f16", "f64"), ("bf16", "f64"), ("f32", "f64"),
    ("i8", "i16"), ("i8", "i32"), ("i8", "i64"), ("i16", "i32"), ("i16", "i64"), ("i32", "i64"),
    ("u8", "i16"), ("u8", "i32"), ("u8", "i64"), ("b8", "u8"), ("b8", "i64"),
}


def _contiguous(t: Term) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(t.meta.shape, t.meta.strides, strict=False))):
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return len(t.meta.strides) == len(t.meta.shape)


def _same_layout(a: Term, b: Term) -> bool:
    """The same sizes and strides, all known."""
    sizes, strides = tuple(a.meta.shape), tuple(a.meta.strides)
    return len(sizes) == len(strides) and sizes == tuple(b.meta.shape) \
        and strides == tuple(b.meta.strides) \
        and all(isinstance(v, int) for v in (*sizes, *strides))


def _same_off(a: Term, b: Term, d: Any) -> bool:
    """The same rank and the same sizes along every dim but `d` (a gather's index and
    its input: rules/decompose/gathers.yaml)."""
    sa, sb = tuple(a.meta.shape), tuple(b.meta.shape)
    if len(sa) != len(sb) or not isinstance(d, int) or not -len(sa) <= d < len(sa):
        return False
    d %= len(sa)
    return all(x == y for k, (x, y) in enumerate(zip(sa, sb, strict=True)) if k != d)


def broadcast_view(y: Term, t: Term, size: Any) -> tuple[int, ...] | None:
    """The shape operand `y` of pointwise work `t` takes when `t` is viewed as `size`:
    view(f(x, y), size) == f(view(x, .), view(y, .)). Dims of t merged or split by the
    view must be all read by y (sizes equal) or none (size 1, broadcast); None where
    they are not (y varies along part of a merged dim: no view of y reads it so), or
    where a size is not known."""
    shape = tuple(t.meta.shape)
    ys = tuple(y.meta.shape)
    if len(ys) > len(shape):
        return None
    ys = (1,) * (len(shape) - len(ys)) + ys
    try:
        target = [int(v) for v in size]
        dims = [int(v) for v in shape]
        ydims = [int(v) for v in ys]
    except (TypeError, ValueError):
        return None
    numel = math.prod(dims)
    if target.count(-1) == 1:
        rest = math.prod(v for v in target if v != -1)
        if rest == 0 or numel % rest:
            return None
        target[target.index(-1)] = numel // rest
    if numel == 0 or math.prod(target) != numel or any(v < 1 for v in target):
        return None
    out = [1] * len(target)
    i = j = 0
    while True:
        while i < len(dims) and dims[i] == 1:
            i += 1
        while j < len(target) and target[j] == 1:
            j += 1
        if i == len(dims) or j == len(target):
            break
        gi, gj, px, pt = [i], [j], dims[i], target[j]
        while px != pt:
            if px < pt:
                i += 1
                gi.append(i)
                px *= dims[i]
            else:
                j += 1
                gj.append(j)
                pt *= target[j]
        i, j = i + 1, j + 1
        read = [ydims[k] != 1 for k in gi if dims[k] != 1]
        if all(read):
            for k in gj:
                out[k] = target[k]
        elif any(read):
            return None
    return tuple(out)


def _views_through(y: Term, t: Term, size: Any) -> bool:
    """`broadcast_view` has a shape for y, and y takes it as a view (no copy): y is
    contiguous, or the view only adds or drops dims of size 1."""
    y = _tensor(y)
    out = broadcast_view(y, _tensor(t), size)
    if out is None:
        return False
    if _contiguous(y):
        return True
    return [v for v in y.meta.shape if v != 1] == [v for v in out if v != 1]


def _reduces_innermost(t: Term) -> bool:
    """`t` reduces along its input's innermost dim in memory (by strides where they
    are known, else the last dim of size other than 1). A row kernel reads such a
    row contiguously; a column (dim 0 of a row-major matrix) it would read one value
    per memory line, several times slower than a reduction kernel that keeps the
    columns as a tile (measured: bias gradients of an MLP, kinds/reduction.py)."""
    dims = t.attr("dim")
    if not t.args or not dims:
        return False
    x = _tensor(t.args[0])
    shape, strides, rank = x.meta.shape, x.meta.strides, x.meta.rank
    reduced = {d % rank for d in dims} if rank else set()
    wide = [k for k in range(rank) if not (isinstance(shape[k], int) and shape[k] == 1)]
    if not wide:
        return True
    if len(strides) == rank and all(isinstance(strides[k], int) for k in wide):
        inner = min(reversed(wide), key=lambda k: strides[k])
    else:
        inner = wide[-1]
    return inner in reduced


def _pointwise_users(ctx: GuardContext, t: Term) -> bool:
    kinds = ctx.user_categories(t)
    return bool(kinds) and all(k == "pointwise" for k in kinds)


def _functions(ctx: GuardContext) -> dict[str, Callable[..., Any]]:
    return {
        "rank": lambda t: _tensor(t).meta.rank,
        "dtype": lambda t: _tensor(t).meta.dtype if _tensor(t).meta.kind == "tensor"
        else "scalar",
        "shape": lambda t: _tensor(t).meta.shape,
        "numel": lambda t: _tensor(t).meta.numel(),
        "device": lambda t: _tensor(t).meta.device.split(":")[0],
        "users": lambda t: ctx.users(_tensor(t)),
        # something reads it, and everything that does is pointwise work (where a
        # pointwise kernel can take in what the rewrite puts after it)
        "pointwise_users": lambda t: _pointwise_users(ctx, _tensor(t)),
        # view(f(x, y), s) can read y through a view (rules/simplify/hoist_views.yaml)
        "views_through": _views_through,
        # work a kernel computes (pointwise, a reduction, a gather), not an input, a
        # view or a library call's result, which a kernel reads where it lies
        "computed": lambda t: ctx.category(_tensor(t)) in COMPUTED,
        "is_const": lambda t: _tensor(t).op in ("const", "tensor") or ctx.is_frozen(_tensor(t)),
        "is_scalar": lambda t: _tensor(t).meta.kind == "scalar",
        "is_tensor": lambda t: _tensor(t).meta.kind == "tensor",
        "is_float": lambda t: isinstance(t, float) or (
            isinstance(t, Term) and t.meta.dtype in FLOAT_DTYPES),
        "is_param": lambda t: _tensor(t).op == "input" and _tensor(t).attr("kind") == "param",
        "value": lambda t: _const_value(_tensor(t)),
        "nonneg": _nonneg,
        "contiguous": lambda t: _contiguous(_tensor(t)),
        "reduces_innermost": lambda t: _reduces_innermost(_tensor(t)),
        # clone(x, memory_format=f) keeps x's layout: f is contiguous_format (spelled
        # that way in rule examples, held as the torch object in captured graphs)
        # and x is contiguous already
        "keeps_layout": lambda t, f: str(f).removeprefix("torch.") == "contiguous_format"
        and _contiguous(_tensor(t)),
        "identity_perm": lambda p: tuple(d % len(p) for d in p) == tuple(range(len(p))),
        "widens": lambda a, b: (a, b) in EXACT_WIDENING,
        "same_shape": lambda a, b: tuple(_tensor(a).meta.shape) == tuple(_tensor(b).meta.shape),
        # the same rank and sizes off dim d
        "same_off": lambda a, b, d: _same_off(_tensor(a), _tensor(b), d),
        # the same sizes and strides: one may stand for the other wherever layout counts
        "same_layout": lambda a, b: _same_layout(_tensor(a), _tensor(b)),
        "len": len,
        "abs": abs,
        "min": min,
        "max": max,
    }


# `x.NAME` in a guard: the guard function it stands for (`x.shape` is `shape(x)`).
GUARD_ATTRIBUTES = {"shape": "shape", "dtype": "dtype", "rank": "rank", "ndim": "rank",
                    "numel": "numel", "device": "device"}


class GuardEval:
    def __init__(self, ctx: GuardContext) -> None:
        self.funcs = _functions(ctx)

    def check(self, node: S.Node, env: dict[str, Any]) -> bool:
        """The guard's value; False when it cannot be decided (a symbolic size, a dim
        the term does not have, a value of another type than the guard expects,
        arithmetic beyond engine/arith.py's bounds). A guard that can never be
        evaluated is refused when its rule loads (guard_problem)."""
        try:
            return _truth(self.eval(node, env))
        except (Undecided, TypeError, ValueError, IndexError, KeyError, ArithmeticError):
            return False

    def eval(self, node: S.Node, env: dict[str, Any]) -> Any:
        if isinstance(node, S.Lit):
            return node.value
        if isinstance(node, S.Var):
            if node.name in env:
                return env[node.name]
            if node.name in DTYPE_NAMES:
                return node.name
            raise Undecided(f"unbound name {node.name}")
        if isinstance(node, S.Seq):
            return tuple(self.eval(x, env) for x in node.items)
        if isinstance(node, S.Call):
            fn = self.funcs[node.func]
            return fn(*[self.eval(a, env) for a in node.args])
        if isinstance(node, S.GetAttr):
            return self.funcs[GUARD_ATTRIBUTES[node.attr]](self.eval(node.value, env))
        if isinstance(node, S.Index):
            return self.eval(node.value, env)[self.eval(node.index, env)]
        if isinstance(node, S.Neg):
            return -self.eval(node.operand, env)
        if isinstance(node, S.Not):
            return not _truth(self.eval(node.operand, env))
        if isinstance(node, S.BoolOp):
            left = _truth(self.eval(node.left, env))
            if node.op == "and":
                return left and _truth(self.eval(node.right, env))
            return left or _truth(self.eval(node.right, env))
        if isinstance(node, S.BinOp):
            a, b = self.eval(node.left, env), self.eval(node.right, env)
            if isinstance(a, Term):
                a = _const_value(a)
            if isinstance(b, Term):
                b = _const_value(b)
            return ARITH[node.op](a, b)
        if isinstance(node, S.Compare):
            a, b = self.eval(node.left, env), self.eval(node.right, env)
            if isinstance(a, Term) and a.op == "const":
                a = a.value
            if isinstance(b, Term) and b.op == "const":
                b = b.value
            return _compare(node.op, a, b)
        raise Undecided(f"cannot evaluate {S.show(node)}")


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "in":
        return any(_truth(a == x) for x in b)
    if op == "not in":
        return not any(_truth(a == x) for x in b)
    result = {"==": lambda: a == b, "!=": lambda: a != b, "<": lambda: a < b,
              "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b}[op]()
    return _truth(result)


def _truth(v: Any) -> bool:
    """bool(v), refusing sympy's undecidable relations."""
    if isinstance(v, bool):
        return v
    try:
        return bool(v)
    except TypeError as e:
        raise Undecided(str(e)) from None


GUARD_FUNCTIONS = tuple(_functions(GuardContext(lambda t: 0, lambda t: False)))



# ------------------------------------------------------------------ checked at load
# The type of each guard function's result; `any` where it depends on the graph.
# "term" arguments take a matched term (a variable of the pattern).
_SIGNATURES: dict[str, tuple[tuple[str, ...], str]] = {
    "rank": (("term",), "int"), "dtype": (("term",), "str"), "shape": (("term",), "tuple"),
    "numel": (("term",), "int"), "device": (("term",), "str"), "users": (("term",), "int"),
    "pointwise_users": (("term",), "bool"), "views_through": (("term", "term", "any"), "bool"),
    "computed": (("term",), "bool"),
    "is_const": (("term",), "bool"), "is_scalar": (("term",), "bool"),
    "is_tensor": (("term",), "bool"), "is_float": (("any",), "bool"),
    "is_param": (("term",), "bool"), "value": (("term",), "any"),
    "nonneg": (("term",), "bool"), "contiguous": (("term",), "bool"),
    "reduces_innermost": (("term",), "bool"), "keeps_layout": (("term", "any"), "bool"),
    "identity_perm": (("tuple",), "bool"), "widens": (("str", "str"), "bool"),
    "same_shape": (("term", "term"), "bool"), "same_off": (("term", "term", "int"), "bool"),
    "len": (("sized",), "int"),
    "same_layout": (("term", "term"), "bool"),
    "abs": (("number",), "any"),
}
_VARIADIC = ("min", "max")  # min(a, b) and min(sequence)
_NUMBERS = ("int", "float", "bool")


class GuardTypeError(Exception):
    """A guard that no graph can evaluate: `node` is where it goes wrong."""

    def __init__(self, message: str, node: S.Node) -> None:
        super().__init__(message)
        self.message, self.node = message, node


def guard_problem(node: S.Node, names: dict[str, str]) -> GuardTypeError | None:
    """Why guard `node` can never be evaluated (an unknown attribute, a function given
    the wrong number or kind of arguments, arithmetic or comparison of a tuple with a
    number, indexing a number), or None. `names` maps each bound name to its type
    (`term`, `int`, ..., or `any` for a pattern variable)."""
    try:
        _type(node, names)
    except GuardTypeError as e:
        return e
    return None


def _fits(got: str, want: str) -> bool:
    if got == "any" or want == "any":
        return True
    if want == "number":
        return got in _NUMBERS
    if want == "sized":
        return got in ("tuple", "str")
    if want == "term":
        return got == "term"
    return got == want


def _type(node: S.Node, names: dict[str, str]) -> str:
    if isinstance(node, S.Lit):
        v = node.value
        return ("bool" if isinstance(v, bool) else "int" if isinstance(v, int)
                else "float" if isinstance(v, float) else "str" if isinstance(v, str)
                else "any")
    if isinstance(node, S.Var):
        return names.get(node.name, "str" if node.name in DTYPE_NAMES else "any")
    if isinstance(node, S.Seq):
        for item in node.items:
            _type(item, names)
        return "tuple"
    if isinstance(node, S.Call):
        if node.func in _VARIADIC:
            for arg in node.args:
                _type(arg, names)
            return "any"
        params, result = _SIGNATURES.get(node.func, ((), "any"))
        if node.func in _SIGNATURES and (len(node.args) != len(params) or node.kwargs):
            raise GuardTypeError(f"{node.func}() takes {len(params)} argument"
                                 f"{'s' if len(params) != 1 else ''}, got "
                                 f"{len(node.args) + len(node.kwargs)}", node)
        for arg, want in zip(node.args, params, strict=False):
            got = _type(arg, names)
            if not _fits(got, want):
                raise GuardTypeError(f"{node.func}() takes {_a(want)}, got {_a(got)}: "
                                     f"`{S.show(arg)}`", arg)
        return result
    if isinstance(node, S.GetAttr):
        if node.attr not in GUARD_ATTRIBUTES:
            raise GuardTypeError(f"unknown attribute `.{node.attr}` (known: "
                                 f"{', '.join(sorted(GUARD_ATTRIBUTES))})", node)
        got = _type(node.value, names)
        if not _fits(got, "term"):
            raise GuardTypeError(f"`.{node.attr}` of {_a(got)}: only a matched term has it",
                                 node)
        return _SIGNATURES[GUARD_ATTRIBUTES[node.attr]][1]
    if isinstance(node, S.Index):
        got = _type(node.value, names)
        index = _type(node.index, names)
        if got in (*_NUMBERS, "term") or index not in ("int", "bool", "any"):
            raise GuardTypeError(f"cannot index {_a(got)} with {_a(index)}", node)
        return "any"
    if isinstance(node, S.Neg):
        got = _type(node.operand, names)
        if not _fits(got, "number") and got != "term":
            raise GuardTypeError(f"cannot negate {_a(got)}", node)
        return got if got != "bool" else "int"
    if isinstance(node, S.Not):
        _type(node.operand, names)
        return "bool"
    if isinstance(node, S.BoolOp):
        _type(node.left, names)
        _type(node.right, names)
        return "bool"
    if isinstance(node, S.BinOp | S.Compare):
        return _binary(node, _type(node.left, names), _type(node.right, names))
    return "any"


def _binary(node: S.BinOp | S.Compare, a: str, b: str) -> str:
    # a term in arithmetic stands for its constant value (GuardEval.eval)
    a, b = ("any" if a == "term" else a), ("any" if b == "term" else b)
    if "any" in (a, b):
        return "bool" if isinstance(node, S.Compare) else "any"
    op = node.op
    if isinstance(node, S.Compare):
        if op in ("in", "not in"):
            ok = b == "tuple" or (a == b == "str")
        elif op in ("==", "!="):
            ok = True
        else:
            ok = (a in _NUMBERS and b in _NUMBERS) or a == b
        if not ok:
            raise GuardTypeError(f"`{op}` compares {_a(a)} with {_a(b)}", node)
        return "bool"
    if a in _NUMBERS and b in _NUMBERS:
        return "float" if "float" in (a, b) or op == "/" else "int"
    if op == "+" and a == b and a in ("tuple", "str"):
        return a
    if op == "*" and {a, b} in ({"tuple", "int"}, {"str", "int"}):
        return a if a != "int" else b
    raise GuardTypeError(f"`{op}` of {_a(a)} and {_a(b)}", node)


def _a(t: str) -> str:
    return {"int": "an int", "any": "a value", "term": "a tensor", "sized": "a tuple or str",
            "number": "a number"}.get(t, f"a {t}")
