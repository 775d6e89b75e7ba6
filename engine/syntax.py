"""Parsing rule expressions (`engine/grammar.lark`) into a small frozen AST.

The same grammar reads patterns, replacements and guards. Nothing here is
ever passed to `eval`: the AST is interpreted by `pattern.py` (matching and
building terms) and `guards.py` (guards).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lark

from .errors import RuleError, Where


@dataclass(frozen=True)
class Node:
    line: int = field(default=0, compare=False, kw_only=True)
    col: int = field(default=0, compare=False, kw_only=True)


@dataclass(frozen=True)
class Var(Node):
    name: str


@dataclass(frozen=True)
class Category(Node):
    name: str  # pointwise | reduction | view | extern


@dataclass(frozen=True)
class Lit(Node):
    value: Any  # int | float | str | bool | None


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]
    kwargs: tuple[tuple[str, Node], ...]


@dataclass(frozen=True)
class BinOp(Node):
    op: str  # + - * / // % **
    left: Node
    right: Node


@dataclass(frozen=True)
class Neg(Node):
    operand: Node


@dataclass(frozen=True)
class Not(Node):
    operand: Node


@dataclass(frozen=True)
class BoolOp(Node):
    op: str  # and | or
    left: Node
    right: Node


@dataclass(frozen=True)
class Compare(Node):
    op: str  # == != < <= > >= in, not in
    left: Node
    right: Node


@dataclass(frozen=True)
class GetAttr(Node):
    value: Node
    attr: str


@dataclass(frozen=True)
class Index(Node):
    value: Node
    index: Node


@dataclass(frozen=True)
class Bind(Node):
    """`pattern as name`: the sub-term `pattern` matched, bound to `name`."""

    value: Node
    name: str


@dataclass(frozen=True)
class Seq(Node):
    kind: str  # tuple | list
    items: tuple[Node, ...]


def conjuncts(node: Node) -> list[Node]:
    """`a and b and c` -> [a, b, c]; any other node -> [node]."""
    if isinstance(node, BoolOp) and node.op == "and":
        return conjuncts(node.left) + conjuncts(node.right)
    return [node]


_NAMED_CONSTS = {"True": True, "False": False, "None": None, "inf": float("inf")}


def _pos(meta: Any) -> dict[str, int]:
    if getattr(meta, "empty", True):
        return {}
    return {"line": meta.line, "col": meta.column}


@cache
def _to_ast() -> Any:
    """The lark Transformer from parse trees to the AST. lark is imported on first
    use: a process whose rules come from the rule cache never parses."""
    import lark

    @lark.v_args(meta=True)
    class _ToAst(lark.Transformer):
        def var(self, meta: Any, c: list[Any]) -> Node:
            name = str(c[0])
            if name in _NAMED_CONSTS:
                return Lit(_NAMED_CONSTS[name], **_pos(meta))
            return Var(name, **_pos(meta))

        def category(self, meta: Any, c: list[Any]) -> Node:
            return Category(str(c[0]), **_pos(meta))

        def number(self, meta: Any, c: list[Any]) -> Node:
            text = str(c[0])
            value: int | float = float(text) if any(ch in text for ch in ".eE") else int(text)
            return Lit(value, **_pos(meta))

        def string(self, meta: Any, c: list[Any]) -> Node:
            return Lit(str(c[0])[1:-1], **_pos(meta))

        def call(self, meta: Any, c: list[Any]) -> Node:
            args: list[Node] = []
            kwargs: list[tuple[str, Node]] = []
            for a in (c[1] if len(c) > 1 and c[1] is not None else []):
                if isinstance(a, tuple):
                    kwargs.append(a)
                elif kwargs:
                    raise RuleError("positional argument after keyword argument",
                                    Where("", getattr(a, "line", 0), getattr(a, "col", 0)))
                else:
                    args.append(a)
            return Call(str(c[0]), tuple(args), tuple(kwargs), **_pos(meta))

        def arguments(self, meta: Any, c: list[Any]) -> list[Any]:
            return [x for x in c if x is not None]

        def kwarg(self, meta: Any, c: list[Any]) -> tuple[str, Node]:
            return (str(c[0]), c[1])

        def binop(self, meta: Any, c: list[Any]) -> Node:
            return BinOp(str(c[1]), c[0], c[2], **_pos(meta))

        def pow(self, meta: Any, c: list[Any]) -> Node:
            return BinOp("**", c[0], c[2], **_pos(meta))

        def neg(self, meta: Any, c: list[Any]) -> Node:
            if isinstance(c[0], Lit) and isinstance(c[0].value, int | float) \
                    and not isinstance(c[0].value, bool):
                return Lit(-c[0].value, **_pos(meta))
            return Neg(c[0], **_pos(meta))

        def not_(self, meta: Any, c: list[Any]) -> Node:
            return Not(c[0], **_pos(meta))

        def and_(self, meta: Any, c: list[Any]) -> Node:
            return BoolOp("and", c[0], c[1], **_pos(meta))

        def or_(self, meta: Any, c: list[Any]) -> Node:
            return BoolOp("or", c[0], c[1], **_pos(meta))

        def compare(self, meta: Any, c: list[Any]) -> Node:
            return Compare(c[1], c[0], c[2], **_pos(meta))

        def comp_op(self, meta: Any, c: list[Any]) -> str:
            return " ".join(str(t) for t in c)

        def getattr(self, meta: Any, c: list[Any]) -> Node:
            # at the dot, so that an error about the attribute points at it
            name = c[1]
            pos = {"line": name.line, "col": name.column - 1} \
                if getattr(name, "column", None) else _pos(meta)
            return GetAttr(c[0], str(name), **pos)

        def bind(self, meta: Any, c: list[Any]) -> Node:
            return Bind(c[0], str(c[1]), **_pos(meta))

        def index(self, meta: Any, c: list[Any]) -> Node:
            return Index(c[0], c[1], **_pos(meta))

        # Last in the class: methods named after the grammar's `tuple` and `list`
        # rules would hide the builtins from the annotations after them.
        def tuple(self, meta: Any, c: builtins.list[Any]) -> Node:
            return Seq("tuple", builtins.tuple(x for x in c if x is not None), **_pos(meta))

        def list(self, meta: Any, c: builtins.list[Any]) -> Node:
            return Seq("list", builtins.tuple(x for x in c if x is not None), **_pos(meta))

    return _ToAst


@cache
def _parser() -> lark.Lark:
    import lark  # on first use, as in _to_ast

    grammar = (Path(__file__).parent / "grammar.lark").read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


# The parse errors people make most, with the hint each one gets; a test
# (tests/test_syntax.py) checks every entry, so hints and table stay in step.
EXAMPLE_ERRORS: list[tuple[str, str]] = [
    ("x +", "expression ends too early"),
    ("relu(x", "expression ends too early"),
    ("relu(x))", "unexpected ')' (unbalanced parenthesis?)"),
    ("x = y", "use == to compare; = is only for keyword arguments"),
    ("x $ 2", "unexpected character '$'"),
    ("f(a=1, b)", "positional argument after keyword argument"),
]


def _hint(text: str, err: lark.exceptions.LarkError) -> str:
    import lark  # on first use, as in _to_ast

    if isinstance(err, lark.exceptions.UnexpectedEOF) or (
            isinstance(err, lark.exceptions.UnexpectedToken) and err.token.type == "$END"):
        return "expression ends too early (unbalanced parenthesis or missing operand?)"
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        pos = err.pos_in_stream
        return f"unexpected character {text[pos]!r}" if pos is not None else \
            "unexpected character"
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        if tok.value == "=":
            return "use == to compare; = is only for keyword arguments"
        if tok.value == ")":
            return "unexpected ')' (unbalanced parenthesis?)"
        return f"unexpected {tok.value!r}"
    return str(err).splitlines()[0]


# Bounds on one expression, so that parsing, and every recursive walk of the
# AST after it (compiling, building, guards, sympy), stays far from Python's
# recursion limit and takes milliseconds. The library's longest expression has
# about 130 characters and nests 6 deep.
MAX_EXPR_CHARS = 4000
MAX_EXPR_DEPTH = 100


def parse_expr(text: str, where: Where | None = None) -> Node:
    """Parse one expression; errors carry file:line:col of the offending spot."""
    where = where or Where("<expr>", 1, 1)
    if not isinstance(text, str):
        raise RuleError(f"expected an expression string, got {type(text).__name__}", where)
    if len(text) > MAX_EXPR_CHARS:
        raise RuleError(f"expression too long ({len(text):,} characters; at most "
                        f"{MAX_EXPR_CHARS:,})", where)
    import lark  # on first use, as in _to_ast

    try:
        tree = _parser().parse(text)
        _check_depth(tree, where)
        return _to_ast()().transform(tree)
    except lark.exceptions.VisitError as e:
        inner = e.orig_exc
        if isinstance(inner, RuleError):
            raise RuleError(inner.message, _shift(where, inner.where.line if inner.where else 1,
                                                   inner.where.col if inner.where else 1)) from None
        raise RuleError(f"cannot read expression: {inner}", where) from None
    except lark.exceptions.LarkError as e:
        line = getattr(e, "line", 1) or 1
        col = getattr(e, "column", 1) or 1
        if isinstance(e, lark.exceptions.UnexpectedToken) and e.token.type == "$END":
            line, col = 1, len(text) + 1
        shown = text.strip().replace("\n", "\\n")  # one error, one line
        raise RuleError(f"syntax error: {_hint(text, e)} in `{shown}`",
                        _shift(where, line, col)) from None


def _check_depth(tree: lark.Tree, where: Where) -> None:
    """The parse tree nests at most MAX_EXPR_DEPTH deep (counted without
    recursion: `x + x + ... + x` nests as deep as it is long)."""
    import lark  # on first use, as in _to_ast

    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_EXPR_DEPTH:
            meta = node.meta
            line, col = (meta.line, meta.column) if not getattr(meta, "empty", True) else (1, 1)
            raise RuleError(f"expression nested deeper than {MAX_EXPR_DEPTH} levels",
                            _shift(where, line, col))
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))


def _shift(where: Where, line: int, col: int) -> Where:
    """Position inside an expression -> position in the rule file."""
    if line <= 1:
        return Where(where.file, where.line, where.col + col - 1, where.rule)
    return Where(where.file, where.line + line - 1, col, where.rule)


def walk(node: Node) -> Iterator[Node]:
    """Every node of an expression, the node itself first, in reading order."""
    stack: list[Any] = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Node):
            yield n
            stack.extend(reversed([getattr(n, f) for f in n.__dataclass_fields__]))
        elif isinstance(n, tuple):
            stack.extend(reversed(n))


def variables(node: Node) -> list[Var]:
    """Every variable in an expression, in reading order."""
    return [n for n in walk(node) if isinstance(n, Var)]


def show(node: Node) -> str:
    """Render an AST back as rule-language text."""
    if isinstance(node, Var):
        return node.name
    if isinstance(node, Lit):
        return repr(node.value)
    if isinstance(node, Category):
        return f"@{node.name}"
    if isinstance(node, Call):
        parts = [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs]
        return f"{node.func}({', '.join(parts)})"
    if isinstance(node, BinOp):
        return f"({show(node.left)} {node.op} {show(node.right)})"
    if isinstance(node, Neg):
        return f"-{show(node.operand)}"
    if isinstance(node, Not):
        return f"not {show(node.operand)}"
    if isinstance(node, BoolOp | Compare):
        return f"{show(node.left)} {node.op} {show(node.right)}"
    if isinstance(node, GetAttr):
        return f"{show(node.value)}.{node.attr}"
    if isinstance(node, Index):
        return f"{show(node.value)}[{show(node.index)}]"
    if isinstance(node, Bind):
        return f"({show(node.value)} as {node.name})"
    if isinstance(node, Seq):
        inner = ", ".join(show(x) for x in node.items)
        comma = "," if len(node.items) == 1 else ""
        return f"[{inner}]" if node.kind == "list" else f"({inner}{comma})"
    return "?"
