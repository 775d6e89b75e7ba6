"""One test per rule example: the rule fires on each `examples:` entry with
results equal to the unrewritten graph, and stays quiet on each `no_match:`.
A test id is `rule-name[example N]`, so a failure leads straight to the rule."""

from __future__ import annotations

import pytest

from rewritec.rulecheck import run_example
from rewritec.rulesets import builtin_rules

CASES = [pytest.param(rule, ex, i, True, id=f"{rule.name}[example {i}]")
         for rule in builtin_rules() for i, ex in enumerate(rule.examples)]
CASES += [pytest.param(rule, ex, i, False, id=f"{rule.name}[no_match {i}]")
          for rule in builtin_rules() for i, ex in enumerate(rule.no_match)]


@pytest.mark.parametrize("rule,example,index,fires", CASES)
def test_rule_example(rule, example, index, fires):
    result = run_example(rule, example, index, expect_fire=fires)
    assert result.ok, f"{rule.location} [{rule.name}]: {result.message}"


def test_every_rule_has_doc_and_examples():
    for rule in builtin_rules():
        assert rule.doc and rule.examples, rule.name


@pytest.mark.parametrize("rule", builtin_rules(), ids=lambda r: r.name)
def test_rule_proof_or_numeric_check(rule):
    """`rules check` for each rule: proved by sympy or checked numerically,
    and fp-exact unless it says otherwise."""
    from rewritec.rulecheck import rule_report

    problems, notes = rule_report(rule)
    assert not problems, f"{rule.location} [{rule.name}]: {problems}"


def test_pythagoras_fires_without_fast_math_and_keeps_eager_nan():
    """sin(x)**2 + cos(x)**2 inside a larger expression is rewritten by default: the
    replacement 1 + (x - x) is nan exactly where the sines are (inf, nan)."""
    import torch

    import rewritec
    from rewritec import report

    def f(x, y):
        return torch.relu(x * 0.5 + (torch.sin(x) ** 2 + torch.cos(x) ** 2) * y) - y

    x = torch.tensor([0.0, 1.5, -3.0, 1e30, float("inf"), float("-inf"), float("nan")])
    y = torch.linspace(-1, 1, 7)
    torch._dynamo.reset()
    start = len(report.RECORDS)
    with torch.no_grad():
        got = rewritec.compile(f, strict=True)(x, y)
    assert sum(r.rules_fired.get("sin-cos-pythagoras", 0) for r in report.RECORDS[start:]) == 1
    torch.testing.assert_close(got, f(x, y), equal_nan=True)
    assert got[4:].isnan().all() and not got[:4].isnan().any()


@pytest.mark.parametrize("target", ["aten", "auto"])
def test_square_root_gradients_keep_the_sign_of_zero(target):
    """x ** 0.5's backward reads x ** -0.5, which ATen computes as rsqrt: at -0.0
    the gradient is -inf in eager (pow would give inf). pow-minus-half keeps it."""
    import torch

    import rewritec
    from rewritec import report

    values = [0.0, -0.0, 4.0, float("inf"), 1e-30, float("nan")]
    mine = torch.tensor(values, requires_grad=True)
    ref = torch.tensor(values, requires_grad=True)
    torch._dynamo.reset()
    start = len(report.RECORDS)
    got = rewritec.compile(lambda t: torch.pow(t, 0.5), strict=True, target=target)(mine)
    want = torch.pow(ref, 0.5)
    (g,), (r,) = torch.autograd.grad(got.sum(), [mine]), torch.autograd.grad(want.sum(), [ref])
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(g, r, equal_nan=True)
    assert torch.equal(g[:2].signbit(), r[:2].signbit())  # inf at 0.0, -inf at -0.0
    assert sum(rec.rules_fired.get("pow-minus-half", 0) for rec in report.RECORDS[start:]) == 1


def test_only_fuse_examples_go_to_the_gpu(monkeypatch):
    """On a GPU machine, a fuse rule's example values live on the GPU (its kernels are
    Triton's); every other rule's stay on the CPU they were written for (a guard may
    name the device: pow-half's; a fold's constants are made there)."""
    from rewritec import rulecheck

    devices = []
    real = rulecheck.build_example

    def spy(rule, example, **kw):
        devices.append((rule.kind, kw.get("device")))
        return real(rule, example, **{**kw, "device": "cpu"})

    monkeypatch.setattr(rulecheck, "example_device", lambda target: "cuda")
    monkeypatch.setattr(rulecheck, "build_example", spy)
    rules = {r.name: r for r in builtin_rules()}
    for name in ("pow-half", "conv-affine-fold", "fuse-pointwise"):
        rulecheck.run_example(rules[name], rules[name].examples[0])
    assert devices == [("decompose", "cpu"), ("fold", "cpu"), ("fuse", "cuda")]
