"""The wrapper's order (runtime/wrapper.py: schedule): a value's last readers run
as soon as the others are done where that frees more than it makes, so a sum over
an activation (a weight gradient) does not hold it until the end of the graph."""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.engine.term import Graph, Meta, Term, TermStore
from rewritec.runtime.build import cxx
from rewritec.runtime.wrapper import schedule

TARGETS = (["openmp"] if cxx() else []) + ["aten"]


def chain(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.relu(x) * 2.0
    a = torch.tanh(g @ w)
    b = torch.tanh(a @ w)
    return torch.tanh(b @ w), g.sum(0)


@pytest.mark.parametrize("target", TARGETS)
def test_a_sum_runs_once_its_operand_is_read(tmp_path, target: str) -> None:
    x, w = torch.randn(64, 32), torch.randn(32, 32)
    report.reset()
    torch._dynamo.reset()
    fn = rewritec.compile(chain, target=target, out_dir=str(tmp_path))
    got = fn(x, w)
    for g, want in zip(got, chain(x, w), strict=True):
        torch.testing.assert_close(g, want)
    (source,) = [p.read_text() for p in tmp_path.glob("*.wrapper.py")]
    body = [ln.strip() for ln in source.splitlines()]
    mms = [i for i, ln in enumerate(body) if "aten.mm" in ln]
    assert len(mms) == 3
    # g, read by the first product and the sum: freed before the second product
    g = body[mms[0]].split("(")[1].split(",")[0].strip()
    freed = next(i for i, ln in enumerate(body) if ln.startswith("del ")
                 and g in ln.removeprefix("del ").replace(",", " ").split())
    assert freed < mms[1], source


def test_only_movable_terms_move() -> None:
    """Terms the wrapper may not move (ATen calls outside the op table: a dropout's
    random draws) keep their order; every term still follows its operands."""
    store = TermStore()

    def meta(*shape: int) -> Meta:
        return Meta(shape=shape, strides=tuple(int(s) for s in
                                                torch.empty(shape).stride()))

    x = store.make("input", (), {"name": "x", "index": 0}, meta=meta(64, 8))
    r1 = store.make("aten", [x], {"target": "rand_like"}, meta=meta(64, 8))
    chain = store.make("exp", [r1], meta=meta(64, 8))
    s1 = store.make("sum", [r1], {"dim": (0,), "keepdim": False}, meta=meta(8))
    r2 = store.make("aten", [chain], {"target": "rand_like"}, meta=meta(64, 8))
    s2 = store.make("aten", [r1], {"target": "amax_fancy"}, meta=meta(8))
    graph = Graph((x,), (r2, s1, s2))
    movable = lambda t: t.op not in ("aten",)  # noqa: E731
    base, order = graph.terms(), schedule(graph, movable)
    assert sorted(t.uid for t in base) == sorted(t.uid for t in order)
    seen: set[Term] = set()
    for t in order:
        assert all(a in seen for a in t.args), t
        seen.add(t)
    fixed = [t for t in base if not movable(t)]
    assert [t for t in order if not movable(t)] == fixed
    # s1 reads r1 with s2 (not movable): it waits for s2, as the depth-first order has it
    assert order.index(s1) > order.index(chain)
