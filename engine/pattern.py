"""Patterns: compiled from rule expressions, matched against terms.

A pattern is a tree of:
- `PVar`: binds a sub-term (or an attribute value); the same name twice
  means the same term, which hash-consing makes an identity test;
- `PAny`: `_`, matches anything and binds nothing;
- `PBind`: `pattern as name` matches `pattern` and binds the term to `name`
  (so a guard can ask, say, how many users an inner term has);
- `PLit`: a literal; matches only a `const` term of equal value, so a
  constant in a pattern never silently becomes a wildcard;
- `POp`: an op with argument patterns and attribute patterns. Attributes the
  pattern leaves out must equal the op's defaults (an under-constrained
  pattern cannot match more than it says).

Associative-commutative ops (`+`, `*`, maximum, minimum) are matched as
multisets of operands, at a bounded cost (`acmatch.py`); other commutative
ops try both argument orders, lazily. Every match has a step budget: a
pattern that would take longer fails with `MatchBudget`, never hangs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import syntax as S
from .acmatch import Flat, MatchBudget, assignments, flatten, is_ac
from .arith import ARITH
from .errors import RuleError, Where
from .guards import DTYPE_NAMES
from .ops import CATEGORIES, OpInfo, OpTable
from .term import Term, TermStore, freeze, lit_equal

Env = dict[str, Any]
PLAIN_NAME = re.compile(r"[A-Za-z0-9_]*")


@dataclass(frozen=True)
class Pattern:
    line: int = field(default=0, compare=False, kw_only=True)
    col: int = field(default=0, compare=False, kw_only=True)


@dataclass(frozen=True)
class PVar(Pattern):
    name: str


@dataclass(frozen=True)
class PAny(Pattern):
    pass


@dataclass(frozen=True)
class PBind(Pattern):
    name: str
    inner: Pattern


@dataclass(frozen=True)
class PCat(Pattern):
    """`@pointwise`: any term whose op has this op-table category."""

    category: str


@dataclass(frozen=True)
class PLit(Pattern):
    value: Any


@dataclass(frozen=True)
class POp(Pattern):
    op: str
    args: tuple[Pattern, ...]
    attrs: tuple[tuple[str, Pattern], ...]  # attributes the pattern names
    defaults: tuple[tuple[str, Any], ...]  # the others: must equal these
    # An associative-commutative op with default attributes: its operands under
    # any nesting of the same op, matched as a multiset (`acmatch.py`); else ().
    flat: tuple[Pattern, ...] = field(default=(), compare=False, repr=False, kw_only=True)


def size(p: Pattern) -> int:
    if isinstance(p, PBind):
        return size(p.inner)
    if isinstance(p, POp):
        return 1 + sum(size(a) for a in p.args) + sum(size(v) for _, v in p.attrs)
    return 1


def op_name(node: S.Node, table: OpTable) -> tuple[str, list[S.Node], list[tuple[str, S.Node]]]:
    """The op, operands and keyword attributes an expression node applies."""
    if isinstance(node, S.Call):
        return node.func, list(node.args), list(node.kwargs)
    if isinstance(node, S.BinOp):
        name = table.infix.get(node.op)
        if name is None:
            raise RuleError(f"operator {node.op!r} has no op in the op table", None)
        return name, [node.left, node.right], []
    if isinstance(node, S.Neg):
        return table.prefix["-"], [node.operand], []
    if isinstance(node, S.Index):
        if not isinstance(node.index, S.Lit) or not isinstance(node.index.value, int):
            raise RuleError("only a literal integer index picks an output: op(...)[0]", None)
        return "getitem", [node.value], [("index", node.index)]
    raise RuleError(f"`{S.show(node)}` is not an op application", None)


class Compiler:
    """Compiles expression ASTs into patterns for one rule, checking them."""

    def __init__(self, table: OpTable, where: Where) -> None:
        self.table = table
        self.where = where

    def error(self, msg: str, node: S.Node | None = None) -> RuleError:
        w = self.where
        if node is not None and node.line:
            w = Where(w.file, w.line + node.line - 1,
                      (w.col + node.col - 1) if node.line == 1 else node.col, w.rule)
        return RuleError(msg, w)

    def pattern(self, node: S.Node) -> Pattern:
        pos = {"line": node.line, "col": node.col}
        if isinstance(node, S.Var):
            return PAny(**pos) if node.name == "_" else PVar(node.name, **pos)
        if isinstance(node, S.Lit):
            return PLit(node.value, **pos)
        if isinstance(node, S.Bind):
            if node.name == "_":
                raise self.error("`as _` binds nothing; drop it", node)
            return PBind(node.name, self.pattern(node.value), **pos)
        if isinstance(node, S.Category):

            if node.name not in CATEGORIES:
                raise self.error(f"unknown category @{node.name} (known: "
                                 f"{', '.join('@' + c for c in CATEGORIES)})", node)
            return PCat(node.name, **pos)
        if isinstance(node, S.Seq):
            raise self.error("a list is only allowed as an attribute value", node)
        try:
            name, args, kwargs = op_name(node, self.table)
        except RuleError as e:
            raise self.error(e.message, node) from None
        return self._op(name, args, kwargs, node)

    def _op(self, name: str, args: list[S.Node], kwargs: list[tuple[str, S.Node]],
            node: S.Node) -> POp:
        if name == "getitem":
            return POp("getitem", (self.pattern(args[0]),),
                       (("index", self.attr_pattern(kwargs[0][1])),), (),
                       line=node.line, col=node.col)
        info = self.check_call(name, args, kwargs, node)
        attrs = [(key, self.attr_pattern(value)) for key, value in kwargs]
        named = {k for k, _ in attrs}
        defaults = tuple((k, freeze(v)) for k, v in info.attrs.items() if k not in named)
        operands = tuple(self.pattern(a) for a in args)
        flat = _flat_operands(name, operands) if info.commutative and info.associative \
            and not attrs else ()
        return POp(name, operands, tuple(attrs), defaults, flat=flat,
                   line=node.line, col=node.col)

    def check_call(self, name: str, args: list[S.Node], kwargs: list[tuple[str, S.Node]],
                   node: S.Node) -> OpInfo:
        """The op exists, gets as many operands as it takes, and only its attributes."""
        info = self.table.get(name)
        if info is None:
            raise self.error(f"unknown op {name!r} (not in rules/ops.yaml)", node)
        if len(args) != len(info.args):
            raise self.error(f"{name} takes {len(info.args)} operand(s) "
                             f"({', '.join(info.args)}), got {len(args)}", node)
        for key, value in kwargs:
            if key not in info.attrs:
                known = ", ".join(info.attrs) or "none"
                raise self.error(f"{name} has no attribute {key!r} (known: {known})", value)
            if isinstance(value, S.Lit) and isinstance(value.value, str) \
                    and not PLAIN_NAME.fullmatch(value.value):
                # String attributes are enum-like names ('tanh', 'none'); nothing else
                # should ever travel towards generated code.
                raise self.error(f"{name} attribute {key!r} must be a plain name (letters, "
                                 f"digits, '_'), got {value.value!r}", value)
        return info

    def attr_pattern(self, node: S.Node) -> Pattern:
        if isinstance(node, S.Var):
            return PAny() if node.name == "_" else PVar(node.name)
        value = self.attr_literal(node)
        return PLit(value)

    def attr_literal(self, node: S.Node) -> Any:
        if isinstance(node, S.Lit):
            return node.value
        if isinstance(node, S.Seq):
            return tuple(self.attr_literal(x) for x in node.items)
        raise self.error(f"attribute pattern must be a literal, a list or a variable, "
                         f"not `{S.show(node)}`", node)


def _flat_operands(op: str, operands: tuple[Pattern, ...]) -> tuple[Pattern, ...]:
    """`(a + b) + c` -> (a, b, c): operands under nested `op`s that name no
    attribute. A bound sum (`(a + b) as s`) stays one operand: it must match a
    sum that is in the graph."""
    out: list[Pattern] = []
    for q in operands:
        if isinstance(q, POp) and q.op == op and q.flat:
            out.extend(q.flat)
        else:
            out.append(q)
    return tuple(out)


# ---------------------------------------------------------------------------- matching
@dataclass
class Failure:
    """Why (and how deep into the pattern) a match failed; used by `explain`."""

    depth: int
    reason: str
    term: Term | None = None


# A match that takes more steps than this gives up (MatchBudget): room for
# every rule of the library many times over, far below a visible pause.
MATCH_BUDGET = 100_000


@dataclass
class Rest:
    """A root match that used only some operands of a flattened sum: the
    rewriter puts the leaves outside `used` back around the replacement."""

    flat: Flat
    used: int  # the leaves the pattern matched (bit i: leaf i)


@dataclass
class Matcher:
    table: OpTable
    failure: Failure | None = None  # the deepest failure seen, when tracking
    budget: int = MATCH_BUDGET
    steps: int = 0  # match steps taken: pattern nodes visited and AC choices weighed
    # flattened sums, kept across the matches of one rewrite pass (keyed by term)
    flats: dict[Term, Flat] = field(default_factory=dict)
    # False: sums match as binary trees, both orders at each node (exponential;
    # what benchmarks/engine.py compares the multiset matching with)
    multiset: bool = True
    # (variable, value) -> whether the rule's guards on that variable alone hold
    # (engine/rules.py: Rule.early_guards): a binding they refuse is never made
    admits: Callable[[str, Any], bool] | None = None

    def fail(self, depth: int, reason: str, term: Term | None) -> None:
        if self.failure is None or depth > self.failure.depth:
            self.failure = Failure(depth, reason, term)

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.budget:
            raise MatchBudget(f"match budget ({self.budget} steps) exhausted")

    def match_root(self, p: Pattern, t: Term, env: Env) -> Iterator[tuple[Env, Rest | None]]:
        """Matches of a rule's pattern at `t`. An associative-commutative root also
        matches part of a sum: `a + b` inside `a + c + b`, with `Rest` telling
        which operands it used. Whole matches come first."""
        flat = self._ac_flat(p, t)
        if flat is None:
            for env2 in self.match(p, t, env):
                yield env2, None
            return
        assert isinstance(p, POp)
        for env2, used in assignments(p.flat, flat, env, self._operand(1), self.tick,
                                      partial=True):
            yield env2, None if used == flat.full else Rest(flat, used)

    def match(self, p: Pattern, t: Term, env: Env, depth: int = 0) -> Iterator[Env]:
        self.tick()
        if isinstance(p, PAny):
            yield env
        elif isinstance(p, PVar):
            yield from self._bind(p.name, t, env, depth)
        elif isinstance(p, PBind):
            for env2 in self.match(p.inner, t, env, depth):
                yield from self._bind(p.name, t, env2, depth)
        elif isinstance(p, PCat):
            info = self.table.get(t.op)
            if info is not None and info.category == p.category:
                yield env
            else:
                self.fail(depth, f"category mismatch: pattern wants @{p.category}, term is "
                          f"{t.op}", t)
        elif isinstance(p, PLit):
            if t.op == "const" and lit_equal(t.value, p.value):
                yield env
            else:
                self.fail(depth, f"expected the constant {p.value!r}", t)
        elif isinstance(p, POp):
            yield from self._match_op(p, t, env, depth)

    def _operand(self, depth: int) -> Callable[[Pattern, Term, Env], Iterator[Env]]:
        """How acmatch matches one operand pattern of a sum at `depth`."""
        return lambda q, t, env: self.match(q, t, env, depth)

    def _bind(self, name: str, t: Term, env: Env, depth: int) -> Iterator[Env]:
        """`name` bound to `t`: a new binding, or the same term bound before."""
        bound = env.get(name)
        if bound is None:
            if self.admits is not None and not self.admits(name, t):
                self.fail(depth, f"a guard on `{name}` alone is false", t)
                return
            yield {**env, name: t}
        elif bound is t:
            yield env
        else:
            self.fail(depth, f"`{name}` is bound to a different term", t)

    def _ac_flat(self, p: Pattern, t: Term) -> Flat | None:
        """`t` flattened, when `p` and `t` are the same associative-commutative op
        (and `t` has the attributes `p` asks for); else None."""
        if not (self.multiset and isinstance(p, POp) and p.flat and t.op == p.op):
            return None
        info = self.table.get(p.op)
        if info is None or not is_ac(info, t):
            return None
        flat = self.flats.get(t)
        if flat is None:
            flat = self.flats[t] = flatten(t, info)
        return flat

    def _match_op(self, p: POp, t: Term, env: Env, depth: int) -> Iterator[Env]:
        flat = self._ac_flat(p, t)
        if flat is not None:
            found = False
            operand = self._operand(depth + 1)
            for env2, _ in assignments(p.flat, flat, env, operand, self.tick, partial=False):
                found = True
                yield env2
            if not found:
                self.fail(depth + 1, f"no way to match the {len(p.flat)} operands of the "
                          f"pattern's {p.op} to the {len(flat.leaves)} of the term's", t)
            return
        head = self._match_head(p, t, env, depth)
        if head is None:
            return
        info = self.table.get(p.op)
        orders = [t.args]
        if info is not None and info.commutative and len(t.args) == 2 \
                and t.args[0] is not t.args[1] \
                and all(lit_equal(t.attr(k, v), v) for k, v in info.attrs.items()):
            # Both orders, one at a time (add with alpha != 1 is not commutative).
            orders.append((t.args[1], t.args[0]))
        for args in orders:
            yield from self._match_args(p.args, args, head, depth + 1)

    def _match_head(self, p: POp, t: Term, env: Env, depth: int) -> Env | None:
        """env, with the attributes `p` binds, if `t` has `p`'s op, operand count
        and attributes; else None."""
        if t.op != p.op:
            self.fail(depth, f"op mismatch: pattern wants {p.op}, term is {t.op}", t)
            return None
        if len(t.args) != len(p.args):
            self.fail(depth, "operand count mismatch", t)
            return None
        for key, value in p.defaults:
            if key != "nonce" and not lit_equal(t.attr(key, value), value):
                self.fail(depth + 1, f"attribute mismatch: {key}={t.attr(key)!r}, "
                          f"pattern wants {value!r}", t)
                return None
        for key, ap in p.attrs:
            tv = t.attr(key)
            if isinstance(ap, PLit):
                if not lit_equal(tv, ap.value):
                    self.fail(depth + 1, f"attribute mismatch: {key}={tv!r}, pattern wants "
                              f"{ap.value!r}", t)
                    return None
            elif isinstance(ap, PVar):
                bound = env.get(ap.name)
                if bound is None:
                    env = {**env, ap.name: tv}
                elif not lit_equal(bound, tv):
                    self.fail(depth + 1, f"attribute {key}: `{ap.name}` bound to {bound!r}", t)
                    return None
        return env

    def _match_args(self, pats: tuple[Pattern, ...], args: tuple[Term, ...], env: Env,
                    depth: int) -> Iterator[Env]:
        if not pats:
            yield env
            return
        for env2 in self.match(pats[0], args[0], env, depth):
            yield from self._match_args(pats[1:], args[1:], env2, depth + size(pats[0]))


# ---------------------------------------------------------------------------- building
class Builder:
    """Builds the replacement terms of a rule from its bindings."""

    def __init__(self, table: OpTable, store: TermStore, attr_funcs: dict[str, Any]) -> None:
        self.table = table
        self.store = store
        self.attr_funcs = attr_funcs

    def term(self, node: S.Node, env: Env) -> Term:
        if isinstance(node, S.Var):
            value = env[node.name]
            if isinstance(value, Term):
                return value
            return self.store.const(value)
        if isinstance(node, S.Lit):
            return self.store.const(node.value)
        if self._is_number(node, env):
            # arithmetic on numbers alone (`rm * (1.0 - mo)`, mo bound to an attribute)
            # and attribute functions (`s / channel_count(x)`): computed here, as an
            # attribute value is, since no op takes two numbers
            value = self.attr(node, env)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise TypeError(f"`{S.show(node)}` is {value!r}, not a number")
            return self.store.const(value)
        name, args, kwargs = op_name(node, self.table)
        if name == "getitem":
            return self.store.make("getitem", (self.term(args[0], env),),
                                   (("index", self.attr(kwargs[0][1], env)),))
        info = self.table.ops[name]
        given = {k: self.attr(v, env) for k, v in kwargs}
        attrs = tuple((k, freeze(given.get(k, v))) for k, v in info.attrs.items())
        return self.store.make(name, [self.term(a, env) for a in args], attrs)

    def _is_number(self, node: S.Node, env: Env) -> bool:
        """`node` is a number to compute: arithmetic on literals, variables bound to
        numbers and attribute functions (not ops of the table: `neg` is both)."""
        if isinstance(node, S.BinOp):
            return self._is_number(node.left, env) and self._is_number(node.right, env)
        if isinstance(node, S.Neg):
            return self._is_number(node.operand, env)
        if isinstance(node, S.Call):
            return node.func in self.attr_funcs and node.func not in self.table
        if isinstance(node, S.Lit):
            return isinstance(node.value, int | float) and not isinstance(node.value, bool)
        if isinstance(node, S.Var):
            value = env.get(node.name)
            if isinstance(value, Term) and value.op == "const":
                value = value.value
            return isinstance(value, int | float) and not isinstance(value, bool)
        return False

    def attr(self, node: S.Node, env: Env) -> Any:
        """Evaluate an attribute expression: literals, bound values, lists, small math."""
        if isinstance(node, S.Lit):
            return node.value
        if isinstance(node, S.Var):
            if node.name not in env and node.name in DTYPE_NAMES:
                return node.name
            value = env[node.name]
            if isinstance(value, Term):
                if value.op == "const":
                    return value.value
                raise TypeError(f"`{node.name}` is a tensor, not an attribute value")
            return value
        if isinstance(node, S.Seq):
            return tuple(self.attr(x, env) for x in node.items)
        if isinstance(node, S.Neg):
            return -self.attr(node.operand, env)
        if isinstance(node, S.BinOp):
            a, b = self.attr(node.left, env), self.attr(node.right, env)
            return ARITH[node.op](a, b)
        if isinstance(node, S.Index):
            return self.attr(node.value, env)[self.attr(node.index, env)]
        if isinstance(node, S.Call) and node.func in self.attr_funcs:
            # Attribute functions may look at a bound term's metadata (channel_view(w)).
            args = [env[a.name] if isinstance(a, S.Var) and isinstance(env.get(a.name), Term)
                    else self.attr(a, env) for a in node.args]
            return self.attr_funcs[node.func](*args)
        raise TypeError(f"`{S.show(node)}` is not an attribute expression")

