"""What keeps rewriting a large backward graph cheap, without changing what fires.

- A guard on one pattern variable is checked as soon as the matcher binds it
  (engine/rules.py: Rule.early_guards), so `add(x, c)` with `is_scalar(c)` does not
  weigh every way of splitting a long sum first.
- A rule tried at a term without a rewrite is not tried there again in a later pass
  (the term, hash-consed, is its whole sub-graph), unless its guards read the graph
  around the term (`users`), which another rewrite may change.
"""

from __future__ import annotations

from rewritec.engine.ops import default_op_table
from rewritec.engine.rewrite import Rewriter
from rewritec.engine.rules import Rule, RuleLoader
from rewritec.engine.term import Graph, Meta, Term, TermStore

TABLE = default_op_table()
F32 = Meta((4,), "f32")


def _rules(text: str) -> list[Rule]:
    return RuleLoader().load_file("t.yaml", text="kind: simplify\nrules:\n" + text)


def _inputs(store: TermStore, n: int, dtype: str = "f32") -> list[Term]:
    return [store.make("input", (), (("name", f"x{i}"), ("index", i)),
                       meta=Meta((4,), dtype)) for i in range(n)]


def _sum(store: TermStore, terms: list[Term]) -> Term:
    out = terms[0]
    for t in terms[1:]:
        out = store.make("add", (out, t), meta=out.meta)
    return out


ADD_ZERO = """
  - name: add-float-zero
    doc: "x + 0.0 -> x"
    pattern: add(x, c)
    replace: x
    where:
      - dtype(x) == f32
      - is_scalar(c) and is_float(c) and value(c) == 0.0
    examples: [{expr: "add(x, 0.0)", x: 4xf32}]
"""


def test_a_guard_on_one_variable_prunes_the_sum_before_it_is_split() -> None:
    """A sum of 24 tensors and no float number: no assignment of the two operands is
    ever complete (before: each way of splitting the sum was matched, then refused
    by the guards)."""
    (rule,) = _rules(ADD_ZERO)
    assert set(rule.early_guards) == {"x", "c"}
    store = TermStore()
    xs = _inputs(store, 24)
    root = _sum(store, xs)
    rw = Rewriter(store, TABLE, [rule])
    assert rw.run(Graph(tuple(xs), (root,))).graph.outputs == (root,)
    st = rw.stats["add-float-zero"]
    assert st.matched == 0 and st.fired == 0 and st.rejected_guard > 0


def test_early_guards_leave_what_fires_unchanged() -> None:
    """A 0.0 inside a long sum still goes; the sum's other operands stay."""
    (rule,) = _rules(ADD_ZERO)
    store = TermStore()
    xs = _inputs(store, 6)
    root = store.make("add", (_sum(store, xs[:3]), store.const(0.0)), meta=F32)
    root = store.make("add", (root, _sum(store, xs[3:])), meta=F32)
    rw = Rewriter(store, TABLE, [rule])
    out = rw.run(Graph(tuple(xs), (root,))).graph.outputs[0]
    assert rw.fired["add-float-zero"] == 1

    def leaves(t: Term) -> list[Term]:
        return [x for a in t.args for x in leaves(a)] if t.op == "add" else [t]

    assert sorted(x.uid for x in leaves(out)) == sorted(x.uid for x in xs)


TWO_RULES = """
  - name: relu-relu
    doc: "relu(relu(x)) -> relu(x)"
    pattern: relu(relu(x))
    replace: relu(x)
    examples: [{x: 4xf32}]
  - name: sin-never
    doc: "sin(x) -> x, never (an integer x)"
    pattern: sin(x)
    replace: x
    where:
      - dtype(x) == i64
    examples: [{x: 4xi64}]
  - name: cos-once-used
    doc: "cos(x) -> x, never (an integer x used once)"
    pattern: cos(x)
    replace: x
    where:
      - users(x) == 1 and dtype(x) == i64
    examples: [{x: 4xi64}]
"""


def test_a_try_without_a_rewrite_is_not_repeated_in_later_passes() -> None:
    """relu(relu(relu(relu(b)))) takes passes; sin(a) and cos(a) stay as they are. The
    sin rule is tried at sin(a) once; the cos rule, whose guard counts users, once
    in every pass."""
    rules = _rules(TWO_RULES)
    assert [r.reads_graph for r in rules] == [False, False, True]
    store = TermStore()
    a, b = _inputs(store, 2)
    r = b
    for _ in range(4):
        r = store.make("relu", (r,), meta=F32)
    s = store.make("sin", (a,), meta=F32)
    c = store.make("cos", (a,), meta=F32)
    rw = Rewriter(store, TABLE, rules)
    result = rw.run(Graph((a, b), (s, c, r)))
    out_s, out_c, out_r = result.graph.outputs
    assert out_s is s and out_c is c and out_r.op == "relu" and out_r.args[0] is b
    assert result.passes >= 2
    assert rw.stats["sin-never"].tried == 1
    assert rw.stats["cos-once-used"].tried == result.passes


EXP_BEFORE_POINTWISE = """
  - name: exp-dropped-where-pointwise-reads
    doc: "exp(x) -> x where every reader is pointwise (a made-up rule)"
    pattern: exp(x) as e
    replace: x
    where:
      - pointwise_users(e)
    examples: [{expr: "relu(exp(x))", x: 4xf32}]
"""


def test_pointwise_users_asks_what_reads_a_term() -> None:
    """`pointwise_users` is true where everything that reads the term is a pointwise
    op, false where a view, an extern op or the graph's output reads it; a rule that
    asks is retried in later passes (`reads_graph`), as one counting users is."""
    (rule,) = _rules(EXP_BEFORE_POINTWISE)
    assert rule.reads_graph
    store = TermStore()
    a, b, c = _inputs(store, 3)
    read_by_relu = store.make("relu", (store.make("exp", (a,), meta=F32),), meta=F32)
    by_view = store.make("view", (store.make("exp", (b,), meta=F32),), (("size", (2, 2)),),
                         meta=Meta((2, 2), "f32"))
    returned = store.make("exp", (c,), meta=F32)
    result = Rewriter(store, TABLE, [rule]).run(Graph((a, b, c), (read_by_relu, by_view,
                                                                  returned)))
    relu_out, view_out, exp_out = result.graph.outputs
    assert relu_out.args[0] is a
    assert view_out.args[0].op == "exp" and exp_out.op == "exp"
