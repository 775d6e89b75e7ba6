"""The `explain` option: a flag of the compilation, for rewrite and fuse rules alike."""

from __future__ import annotations

import pytest
import torch
from rewritec import report
from rewritec.engine.fuse import fuse
from rewritec.engine.ops import default_op_table
from rewritec.engine.term import Graph, Meta, TermStore
from rewritec.rulesets import builtin_rules


def _explained(fn, *args, rule: str):
    report.reset()
    torch._dynamo.reset()
    torch.compile(fn, backend="rewritec",
                  options={"explain": rule, "target": "openmp"})(*args)
    assert report.EXPLANATIONS, "no graph recorded an explanation"
    return [e for _, e in report.EXPLANATIONS]


def test_rewrite_rule_closest_match() -> None:
    # half_to_float is not the pattern's: the softmax rule matches only the float path
    (e,) = _explained(lambda x: torch.softmax(x, -1), torch.randn(4, 8), rule="softmax")
    assert e.roots_seen >= 1 and "softmax" in e.ops


def test_fuse_rule_says_which_producer_it_refused() -> None:
    """fuse-row's group around the softmax cannot take the matrix product in."""
    (e,) = _explained(lambda x, w: torch.softmax(x @ w, -1), torch.randn(8, 16),
                      torch.randn(16, 16), rule="fuse-row")
    reasons = [(t.op, why) for _, t, why in e.refused]
    assert ("mm", "its category `extern` is not in the rule's grow list") in reasons


def test_fuse_rule_says_why_a_group_did_not_form() -> None:
    """exp(x) + 1 has no reduction: fuse-row's guard refuses it, fuse-pointwise takes it."""
    (e,) = _explained(lambda x: x.exp() + 1, torch.randn(4, 8), rule="fuse-row")
    whys = {why for root, t, why in e.refused if t is root}
    assert any(w.startswith("guard `reductions >= 1` is false") for w in whys), whys
    assert any("in a kernel of rule fuse-pointwise" in w for w in whys), whys


def test_a_kind_without_a_space_is_an_error() -> None:
    store = TermStore()
    x = store.make("input", (), (("name", "x"), ("kind", "arg")),
                   meta=Meta(kind="tensor", shape=(4,), dtype="f32", device="cpu", strides=(1,)))
    rules = [r for r in builtin_rules() if r.kind == "fuse"]
    with pytest.raises(ValueError, match="no iteration space for kernel kind"):
        fuse(Graph((x,), (x,)), store, default_op_table(), rules, can_compile=lambda t: True,
             spaces={})
