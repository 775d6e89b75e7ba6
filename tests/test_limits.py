"""Bounds that keep a rule file from hanging rewritec or filling memory
(issue 20). The load-time errors are golden files in tests/bad_rules/; these
are the bounds that act later: while matching, rewriting and proving.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rewritec.engine.arith import ARITH, ArithmeticLimit
from rewritec.engine.errors import RewriteStop
from rewritec.engine.ops import default_op_table
from rewritec.engine.prove import prove
from rewritec.engine.rewrite import Rewriter
from rewritec.engine.rules import Rule, RuleLoader
from rewritec.engine.term import Graph, Meta, TermStore

TABLE = default_op_table()
REPO_ROOT = Path(__file__).resolve().parent.parent


def _rules(text: str) -> list[Rule]:
    return RuleLoader().load_file("t.yaml", text="kind: simplify\nrules:\n" + text)


@pytest.mark.parametrize("op,a,b", [("**", 9, 9 ** 9), ("*", "a", 4_000_000_000),
                                    ("*", 2 ** 1000, 2 ** 1000), ("+", "a" * 6000, "b" * 6000),
                                    ("**", 10.0, 400), ("%", "%0999999999d", 1)])
def test_arithmetic_beyond_its_bounds_raises_at_once(op: str, a: object, b: object) -> None:
    start = time.perf_counter()
    with pytest.raises((ArithmeticLimit, TypeError)):
        ARITH[op](a, b)
    assert time.perf_counter() - start < 0.1


def test_a_guard_whose_arithmetic_explodes_at_match_time_is_false() -> None:
    """Not literal, so not refused at load: `x.shape[0] ** 9 ** 9` is computed
    when the rule is tried, and stops at the bound."""
    rules = _rules("""
  - name: mul-one-pow-shape
    doc: "x * 1 -> x"
    pattern: x * 1
    replace: x
    where:
      - x.shape[0] ** 9 ** 9 > 0
    examples: [{x: 4xf32}]
""")
    store = TermStore()
    x = store.make("input", (), (("name", "x"),), meta=Meta((4,), "f32"))
    root = store.make("mul", (x, store.const(1)), meta=Meta((4,), "f32"))
    rw = Rewriter(store, TABLE, rules)
    start = time.perf_counter()
    assert rw.run(Graph((x,), (root,))).graph.outputs == (root,)
    assert time.perf_counter() - start < 1
    # (refused when x is bound, for each operand x might be)
    assert rw.stats["mul-one-pow-shape"].rejected_guard >= 1


def test_the_rewriter_stops_at_its_time_budget() -> None:
    rules = _rules("""
  - name: relu-grow
    doc: "relu(x) -> relu(relu(x))"
    pattern: relu(x)
    replace: relu(relu(x))
    examples: [{x: 4xf32}]
""")
    store = TermStore(lambda op, args, attrs: args[0].meta)
    x = store.make("input", (), (("name", "x"),), meta=Meta((4,), "f32"))
    root = store.make("relu", (x,))
    with pytest.raises(RewriteStop, match=r"time budget \(0 s\) exhausted"):
        Rewriter(store, TABLE, rules, seconds=0).run(Graph((x,), (root,)))


_SLOW = """
  - name: sigmoid-tanh-7
    doc: "not an identity: sympy works on it for a while before it says so"
    pattern: sigmoid(exp(exp(exp(exp(exp(exp(exp(x))))))))
    replace: tanh(exp(exp(exp(exp(exp(exp(exp(x))))))))
    examples: [{x: 4xf32}]
"""


def test_a_proof_out_of_time_is_not_proved_on_the_main_thread() -> None:
    rule = _rules(_SLOW)[0]
    prove(rule, TABLE, seconds=0.01)  # sympy's first import is not the deadline's cost
    start = time.perf_counter()
    proof = prove(rule, TABLE, seconds=0.01)
    assert time.perf_counter() - start < 0.5
    assert (proof.status, proof.detail) == ("not-proved", "sympy gave up after 0.01 s")
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler)


def test_a_proof_out_of_time_is_not_proved_on_another_thread() -> None:
    rule = _rules(_SLOW)[0]
    proofs = []
    worker = threading.Thread(target=lambda: proofs.append(prove(rule, TABLE, seconds=0.01)))
    worker.start()
    worker.join(5)
    assert proofs and proofs[0].status == "not-proved"


def test_cli_refuses_an_alias_bomb_in_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "rewritec.cli", "rules", "check", "--rules",
                          "tests/bad_rules/yaml_alias_bomb.yaml"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    want = (REPO_ROOT / "tests/bad_rules/yaml_alias_bomb.expected").read_text().rstrip("\n")
    assert res.returncode == 2
    assert res.stderr.rstrip("\n") == f"rewritec: error: {want}"
