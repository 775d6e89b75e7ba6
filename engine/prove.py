"""Proving pointwise rules exact over the reals with sympy.

A rule whose pattern and replacement use only pointwise ops with a sympy
counterpart is proved when `simplify(pattern - replacement) == 0` with its
variables as real symbols (or, failing that, positive ones: the proof then
holds for x > 0 only, which the rule's guard must ensure). Other rules are
checked numerically (see `rulecheck.py`).

sympy cannot be interrupted cooperatively, and `simplify` on a few nested
exponentials can run for minutes, so a proof gets PROOF_SECONDS: on the main
thread of a POSIX process a SIGALRM timer stops it; elsewhere it runs on a
daemon thread that is abandoned at the deadline. Either way a proof that runs
out of time is `not-proved`, never a hang.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import sympy

from . import syntax as S
from .ops import OpTable
from .pattern import op_name
from .rules import Rule

_SYMPY: dict[str, Callable[..., Any]] = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "pow": lambda x, y: x ** y,
    "neg": lambda x: -x,
    "abs": sympy.Abs,
    "exp": sympy.exp,
    "log": sympy.log,
    "sqrt": sympy.sqrt,
    "rsqrt": lambda x: 1 / sympy.sqrt(x),
    "reciprocal": lambda x: 1 / x,
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tanh": sympy.tanh,
    "sigmoid": lambda x: 1 / (1 + sympy.exp(-x)),
    "erf": sympy.erf,
    "relu": lambda x: sympy.Max(0, x),
    "ones_like": lambda x: sympy.Integer(1),
    "zeros_like": lambda x: sympy.Integer(0),
    "clone": lambda x: x,
    "alias": lambda x: x,
}


@dataclass(frozen=True)
class Proof:
    status: str  # proved | proved-positive | not-proved | not-applicable
    detail: str = ""


class _NotPointwise(Exception):
    pass


PROOF_SECONDS = 5.0
T = TypeVar("T")


class _Deadline(BaseException):
    """Raised into sympy by the timer; a BaseException, so that sympy's own
    `except Exception` clauses do not swallow it."""


def with_deadline(fn: Callable[[], T], seconds: float) -> T | None:
    """fn(), or None when it takes more than `seconds`."""
    timer_free = hasattr(signal, "setitimer") and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    if not (timer_free and threading.current_thread() is threading.main_thread()):
        box: list[T] = []
        worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
        worker.start()
        worker.join(seconds)
        return box[0] if box else None

    def expire(signum: int, frame: Any) -> None:
        raise _Deadline

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return None  # also when the timer fired just after fn returned
    finally:
        signal.signal(signal.SIGALRM, previous)


def to_sympy(node: S.Node, table: OpTable, symbols: dict[str, sympy.Symbol]) -> Any:
    if isinstance(node, S.Var):
        return symbols[node.name]
    if isinstance(node, S.Lit):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise _NotPointwise
        return sympy.nsimplify(node.value, rational=True)
    try:
        name, args, kwargs = op_name(node, table)
    except Exception:  # noqa: BLE001
        raise _NotPointwise from None
    fn = _SYMPY.get(name)
    if fn is None or kwargs:
        raise _NotPointwise
    return fn(*[to_sympy(a, table, symbols) for a in args])


def prove(rule: Rule, table: OpTable, seconds: float = PROOF_SECONDS) -> Proof:
    if rule.replace is None:
        return Proof("not-applicable", "fusion rules keep semantics by construction")
    proof = with_deadline(lambda: _prove(rule, table), seconds)
    if proof is None:
        return Proof("not-proved", f"sympy gave up after {seconds:g} s")
    return proof


def _prove(rule: Rule, table: OpTable) -> Proof:
    assert rule.replace is not None
    pattern_ast = S.parse_expr(rule.pattern_src)
    names = sorted({v.name for v in S.variables(pattern_ast)})
    for assumptions, status in (({"real": True}, "proved"),
                                ({"positive": True}, "proved-positive")):
        symbols = {n: sympy.Symbol(n, **assumptions) for n in names}
        try:
            lhs = to_sympy(pattern_ast, table, symbols)
            rhs = to_sympy(rule.replace, table, symbols)
        except (_NotPointwise, KeyError):
            return Proof("not-applicable", "not a pointwise algebraic rule")
        diff = sympy.simplify((lhs - rhs).rewrite(sympy.exp))
        if diff == 0:
            return Proof(status, f"{lhs} == {rhs}")
    return Proof("not-proved", f"simplify({lhs} - ({rhs})) = {diff}")
