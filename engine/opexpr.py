"""Checking an op's kernel expressions (`triton:` and `cpp:` in an op table) when
they load.

A user's op puts its expressions into generated Triton (Python) and C++ source,
so each is read here first: its `{name}` placeholders must be the op's operands or
attributes, and it may use only arithmetic, comparisons, the operands and a fixed
set of math functions (`tl.exp`, `std::log1p`, ...). Anything else (a name, an
attribute outside `tl`, a string, a statement) is a `file:line:col` error, so an
op table cannot smuggle code into a kernel. Torch-free, as the engine is.
"""

from __future__ import annotations

import ast
import re

from .errors import RuleError, Where

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

# Elementwise functions and constants of triton.language an expression may call or name.
TRITON_NAMES = frozenset({
    "abs", "ceil", "clamp", "cos", "div_rn", "erf", "exp", "exp2", "fdiv", "floor", "fma",
    "log", "log2", "maximum", "minimum", "rsqrt", "sigmoid", "sin", "sqrt", "sqrt_rn",
    "where", "PropagateNan", "float16", "float32", "float64", "bfloat16", "int1", "int32",
    "int64",
})
# Values a Triton expression may call methods of: `x.to(tl.float32)`.
TRITON_METHODS = frozenset({"to"})
_TRITON_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.keyword,
                 ast.Name, ast.Attribute, ast.Constant, ast.Load, ast.operator, ast.unaryop,
                 ast.cmpop, ast.IfExp)

# <cmath> functions and constants a C++ expression may use.
CPP_FUNCTIONS = frozenset({
    "abs", "fabs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "cbrt",
    "pow", "hypot", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "tgamma", "lgamma", "floor", "ceil",
    "trunc", "round", "nearbyint", "fmin", "fmax", "fmod", "copysign", "isnan", "isinf",
    "isfinite", "signbit",
})
CPP_NAMES = frozenset({"INFINITY", "NAN", "float", "double"})
_CPP_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<std>std::[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?[fF]?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>&&|\|\||==|!=|<=|>=|<<|>>|[-+*/%<>!?:(),&|^~])
""", re.VERBOSE)


def check_expression(expr: str, target: str, operands: tuple[str, ...],
                     attrs: tuple[str, ...], where: Where) -> None:
    """Raise a RuleError at the first thing in `expr` that is not allowed."""
    bound = set(operands) | set(attrs)
    for m in PLACEHOLDER.finditer(expr):
        if m.group(1) not in bound:
            raise RuleError(f"unbound operand {{{m.group(1)}}} in the {target} expression "
                            f"(the op has: {', '.join(operands + attrs) or 'none'})",
                            _at(where, m.start()))
    # each placeholder becomes a name of the same length, so columns stay true
    plain = PLACEHOLDER.sub(lambda m: "_" * (len(m.group(0)) - 1) + "v", expr)
    if "{" in plain or "}" in plain:
        i = min(k for k in (plain.find("{"), plain.find("}")) if k >= 0)
        raise RuleError("a brace outside a `{operand}` placeholder", _at(where, i))
    if target == "triton":
        _check_triton(plain, where)
    else:
        _check_cpp(plain, where)


def _at(where: Where, offset: int) -> Where:
    return Where(where.file, where.line, where.col + offset if where.col else 0, where.rule)


def _check_triton(text: str, where: Where) -> None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise RuleError(f"the triton expression is not an expression: {e.msg}",
                        _at(where, max(0, (e.offset or 1) - 1))) from None
    lead = len(text) - len(text.lstrip())
    # `float('inf')` is how a literal infinity is spelled (codegen/kernels.py: literal)
    infinities = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and isinstance(n.func, ast.Name) and n.func.id == "float"
                  and len(n.args) == 1 and not n.keywords
                  and isinstance(n.args[0], ast.Constant) and n.args[0].value in _FLOAT_WORDS}
    for node in ast.walk(tree):
        col = lead + getattr(node, "col_offset", 0)
        if not isinstance(node, _TRITON_NODES):
            raise RuleError(f"`{type(node).__name__}` is not allowed in a triton expression "
                            "(arithmetic, comparisons, calls of tl functions only)",
                            _at(where, col))
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float) \
                and node.value not in _FLOAT_WORDS:
            raise RuleError(f"constant {node.value!r} is not allowed in a triton expression",
                            _at(where, col))
        if isinstance(node, ast.Name) and node.id != "tl" and id(node) not in infinities \
                and not re.fullmatch(r"_*v", node.id):
            raise RuleError(f"unknown name {node.id!r} in the triton expression (operands "
                            "are written `{x}`; functions are `tl.NAME`)", _at(where, col))
        if isinstance(node, ast.Attribute):
            _check_triton_attribute(node, where, col)


_FLOAT_WORDS = ("inf", "-inf", "nan")


def _check_triton_attribute(node: ast.Attribute, where: Where, col: int) -> None:
    base = node.value
    if isinstance(base, ast.Name) and base.id == "tl":
        if node.attr not in TRITON_NAMES:
            raise RuleError(f"unknown function tl.{node.attr} in the triton expression "
                            f"(known: {', '.join(sorted(TRITON_NAMES))})", _at(where, col))
        return
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
            and base.value.id == "tl" and base.attr == "PropagateNan" \
            and node.attr in ("ALL", "NONE"):
        return
    if node.attr in TRITON_METHODS:  # a value's method: `({x} > 0).to(tl.float32)`
        return
    raise RuleError(f"attribute `.{node.attr}` is not allowed in a triton expression "
                    "(only tl.NAME and VALUE.to(DTYPE))", _at(where, col))


def _check_cpp(text: str, where: Where) -> None:
    pos, depth = 0, 0
    while pos < len(text):
        m = _CPP_TOKEN.match(text, pos)
        if m is None:
            raise RuleError(f"{text[pos]!r} is not allowed in a cpp expression (arithmetic, "
                            "comparisons, `?:`, calls of std:: math functions only)",
                            _at(where, pos))
        kind, token = m.lastgroup, m.group(0)
        if kind == "std" and token[5:] not in CPP_FUNCTIONS:
            raise RuleError(f"unknown function {token} in the cpp expression (known: "
                            f"std::{', std::'.join(sorted(CPP_FUNCTIONS))})", _at(where, pos))
        if kind == "name" and token not in CPP_NAMES and not re.fullmatch(r"_*v", token):
            raise RuleError(f"unknown name {token!r} in the cpp expression (operands are "
                            "written `{x}`; functions are `std::NAME`)", _at(where, pos))
        if token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
            if depth < 0:
                raise RuleError("unbalanced `)` in the cpp expression", _at(where, pos))
        pos = m.end()
    if depth:
        raise RuleError("unbalanced `(` in the cpp expression", _at(where, len(text)))
