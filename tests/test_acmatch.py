"""Associative-commutative matching (engine/acmatch.py): a sum matches as the
multiset of its operands, whatever their grouping, at a polynomial cost.

- sin-cos-pythagoras fires on regrouped sums, compiled == eager;
- random regroupings (hypothesis): the rule fires and the value is kept;
- what must not be regrouped: add with alpha != 1, sums of another dtype,
  a replacement whose type differs from the operands it replaces;
- cost: match steps (not seconds) against pattern size, and the budget.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewritec import report
from rewritec.benchmarks.engine import failing_sum
from rewritec.engine.acmatch import MatchBudget, flatten
from rewritec.engine.ops import default_op_table
from rewritec.engine.pattern import Matcher, size
from rewritec.engine.rewrite import Rewriter
from rewritec.engine.rules import Rule, RuleLoader
from rewritec.engine.term import Graph, Meta, Term, TermStore
from rewritec.rulesets import builtin_rules

TABLE = default_op_table()


def _rule(name: str) -> Rule:
    return next(r for r in builtin_rules() if r.name == name)


# ------------------------------------------------------------- compiled == eager
def _fired(fn: Any, *inputs: torch.Tensor) -> int:
    torch._dynamo.reset()
    start = len(report.RECORDS)
    got = torch.compile(fn, backend="rewritec")(*inputs)
    torch.testing.assert_close(got, fn(*inputs))
    return sum(r.rules_fired.get("sin-cos-pythagoras", 0) for r in report.RECORDS[start:])


@pytest.mark.parametrize("fn", [
    lambda x: (torch.sin(x) ** 2 + 1) + torch.cos(x) ** 2,
    lambda x: torch.cos(x) ** 2 + (2.5 + torch.sin(x) ** 2),
    lambda x: ((torch.sin(x) ** 2 + x) + 3) + torch.cos(x) ** 2,
    lambda x: torch.exp(x) * (torch.cos(x) ** 2 + (x.abs() + torch.sin(x) ** 2)),
], ids=["sin2-1-cos2", "cos2-(c-sin2)", "sin2-x-3-cos2", "inside-a-product"])
def test_sin_cos_pythagoras_fires_on_a_regrouped_sum(fn: Any) -> None:
    assert _fired(fn, torch.randn(16)) == 1


def test_sin_cos_pythagoras_regroups_across_an_int_operand() -> None:
    """i64 + f32 promotes to f32 wherever it happens: the inner sum is f32 too."""
    def fn(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) ** 2 + i) + torch.cos(x) ** 2

    assert _fired(fn, torch.randn(16), torch.arange(16)) == 1


def test_sin_cos_pythagoras_does_not_regroup_an_alpha_add() -> None:
    """add(a, b, alpha=2) is a + 2 * b: not associative with the outer +."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.add(torch.sin(x) ** 2, y, alpha=2) + torch.cos(x) ** 2

    assert _fired(fn, torch.randn(16), torch.randn(16)) == 0


# ------------------------------------------------------------- engine only
def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + s for s in shapes]
    return tuple(max(d) for d in zip(*padded, strict=True))


def _hook(op: str, args: tuple[Term, ...], attrs: Any) -> Meta:
    """Shapes broadcast; f32 unless every tensor operand is i64."""
    tensors = [a.meta for a in args if a.meta.kind == "tensor"]
    dtype = "i64" if tensors and all(m.dtype == "i64" for m in tensors) else "f32"
    return Meta(_broadcast(*(m.shape for m in tensors)) if tensors else (), dtype)


def _input(store: TermStore, name: str, shape: tuple[int, ...] = (4,),
           dtype: str = "f32") -> Term:
    return store.make("input", (), (("name", name),), meta=Meta(shape, dtype))


def _add(store: TermStore, a: Term, b: Term, alpha: int = 1) -> Term:
    return store.make("add", (a, b), (("alpha", alpha),))


def _rewrite(store: TermStore, root: Term, rules: list[Rule]) -> tuple[Term, int]:
    result = Rewriter(store, TABLE, rules).run(Graph((), (root,)))
    out = result.graph.outputs[0]
    assert out is not None
    return out, sum(result.fired.values())


_FUNCS = {"sin": math.sin, "cos": math.cos, "mul": lambda a, b: a * b,
          "sub": lambda a, b, alpha=1: a - alpha * b, "add": lambda a, b, alpha=1: a + alpha * b,
          "ones_like": lambda a: 1.0}


def _value(t: Term, inputs: dict[str, float]) -> float:
    if t.op == "const":
        return float(t.value)
    if t.op == "input":
        return inputs[t.attr("name")]
    args = [_value(a, inputs) for a in t.args]
    return _FUNCS[t.op](*args, **{k: v for k, v in t.attrs if k == "alpha"})


def _grouped(store: TermStore, leaves: list[Term], cuts: list[int]) -> Term:
    """The sum of `leaves` grouped by `cuts` (each picks where a group splits)."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1 + cuts[0] % (len(leaves) - 1) if cuts else 1
    rest = cuts[1:]
    return _add(store, _grouped(store, leaves[:k], rest), _grouped(store, leaves[k:], rest))


@settings(derandomize=True, deadline=None, database=None, max_examples=60)
@given(extra=st.lists(st.sampled_from(["y", "z", "1", "2.5", "sin(y)"]), max_size=5),
       order=st.randoms(use_true_random=False), cuts=st.lists(st.integers(0, 50), max_size=8))
def test_pythagoras_fires_on_any_grouping_and_keeps_the_value(extra: list[str], order: Any,
                                                              cuts: list[int]) -> None:
    store = TermStore(_hook)
    x, y, z = (_input(store, n) for n in "xyz")
    sin, cos = (store.make(f, (x,)) for f in ("sin", "cos"))
    make = {"y": y, "z": z, "1": store.const(1), "2.5": store.const(2.5),
            "sin(y)": store.make("sin", (y,))}
    leaves = [store.make("mul", (sin, sin)), store.make("mul", (cos, cos))]
    leaves += [make[e] for e in extra]
    order.shuffle(leaves)
    root = _grouped(store, leaves, cuts)
    out, fired = _rewrite(store, root, [_rule("sin-cos-pythagoras")])
    assert fired == 1
    assert "sin" not in {t.op for t in out.walk() if x in t.args}
    point = {"x": 0.7, "y": -1.3, "z": 2.0}
    assert math.isclose(_value(out, point), _value(root, point), rel_tol=1e-12)


def test_a_partial_match_keeps_the_type_of_the_operands_it_replaces() -> None:
    """x[4] + sin(y)[3,4] + z[3,4]: a replacement of shape [4] for x + sin(y) would
    still broadcast back to [3,4] with z, but x + sin(y) had shape [3,4]: refused."""
    rules = RuleLoader().load_file("t.yaml", text="""
kind: simplify
rules:
  - name: drop-sin
    doc: "x + sin(y) -> x"
    pattern: x + sin(y)
    replace: x
    where: [rank(x) == 1]
    examples: [{x: 4xf32, y: 4xf32}]
""")
    store = TermStore(_hook)
    x, y, z = _input(store, "x", (4,)), _input(store, "y", (3, 4)), _input(store, "z", (3, 4))
    root = _add(store, _add(store, x, store.make("sin", (y,))), z)
    assert _rewrite(store, root, rules) == (root, 0)
    # where the shapes agree it fires, and keeps z
    y2 = _input(store, "y2", (4,))
    root2 = _add(store, _add(store, x, store.make("sin", (y2,))), z)
    out, fired = _rewrite(store, root2, rules)
    assert fired == 1 and out is _add(store, x, z)


def test_flatten_stops_at_another_dtype_and_at_alpha() -> None:
    store = TermStore(_hook)
    a, b = _input(store, "a", dtype="i64"), _input(store, "b", dtype="i64")
    c, d = _input(store, "c"), _input(store, "d")
    ints = _add(store, a, b)  # i64: its rounding differs from a float sum's
    alpha = _add(store, c, d, alpha=2)
    root = _add(store, _add(store, ints, alpha), c)
    flat = flatten(root, TABLE.ops["add"])
    assert flat.leaves == (ints, alpha, c)


# ------------------------------------------------------------- cost
def _steps(kind: str, nodes: int) -> int:
    pattern, term = failing_sum(kind, nodes)
    assert size(pattern) == nodes
    matcher = Matcher(TABLE)
    assert next(matcher.match_root(pattern, term, {}), None) is None
    return matcher.steps


@pytest.mark.parametrize("kind", ["lit", "var", "mul"])
def test_match_steps_grow_polynomially_with_pattern_size(kind: str) -> None:
    """Binary commutative matching takes about 2^(size/2) steps on these patterns
    (SUM_KINDS in benchmarks/engine.py); the multiset matcher's grow at most as
    size^3.6 (12x for twice the size)."""
    steps = {n: _steps(kind, n) for n in (7, 15, 31, 63)}
    assert steps[31] < 20_000, steps
    for small, big in ((15, 31), (31, 63)):
        assert steps[big] <= 12 * steps[small], steps


def test_the_match_budget_stops_a_match_and_the_rewriter_goes_on() -> None:
    pattern, term = failing_sum("var", 63)
    with pytest.raises(MatchBudget):
        next(Matcher(TABLE, budget=500).match_root(pattern, term, {}), None)
    rule = RuleLoader().load_file("t.yaml", text="""
kind: simplify
rules:
  - name: wide
    doc: "x0 + ... + x0 -> x0"
    pattern: "((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x0))"
    replace: x0
    examples: [{x0: 4xf32}]
""")
    rw = Rewriter(TermStore(), TABLE, rule, match_budget=20)
    assert rw.run(Graph((), (term,))).stop_reason == "saturated"
    assert rw.stats["wide"].gave_up >= 1 and rw.stats["wide"].fired == 0
