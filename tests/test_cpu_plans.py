"""Launch plans and graph plans on the CPU: an OpenMP launcher keeps, per input
signature, its outputs' layouts and the integers it passes (runtime/launch.py:
`_CppPlan`), and a compiled CPU graph called twice with one signature runs a
variant of its wrapper with those launches and its views written out
(runtime/graph_plans.py). Every result is checked against eager, call after call,
over layouts, dtypes and a training step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import rewritec.compiler
from rewritec.runtime import graph_plans
from rewritec.runtime.build import cxx
from rewritec.runtime.graph_plans import PlannedGraph
from rewritec.runtime.launch import CppLauncher

pytestmark = pytest.mark.skipif(cxx() is None, reason="no C++ compiler")


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The wrappers compiled while the test runs, as `planned` returned them."""
    made: list[Any] = []
    monkeypatch.delenv("REWRITEC_GRAPH_PLANS", raising=False)

    def keep(fn: Any, source: str) -> Any:
        made.append(graph_plans.planned(fn, source))
        return made[-1]

    monkeypatch.setattr(rewritec.compiler, "planned", keep)
    torch._dynamo.reset()
    yield made
    torch._dynamo.reset()


def _compiled(fn: Any) -> Any:
    return torch.compile(fn, backend="rewritec", options={"target": "openmp"})


def _variant_sources(made: list[Any]) -> list[str]:
    return [src for g in made if isinstance(g, PlannedGraph) for src in g.sources.values()]


def mixed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pointwise with broadcasts, a row (layer norm, softmax), a column sum and
    views between them."""
    h = F.layer_norm(x * 2.0 + 1.0, x.shape[-1:], w, b)
    p = torch.softmax(h.transpose(-1, -2).reshape(-1, x.shape[-2]), dim=-1)
    return p.reshape(x.shape[0], -1).sum(0) + torch.relu(h).mean()


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_graph_runs_its_written_variant_and_equals_eager(graphs, shape, dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    w, b = torch.randn(shape[-1], dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    f = _compiled(mixed)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for _ in range(4):  # plain, recording, then the variant twice
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(f(x, w, b), mixed(x, w, b), **tol)
    sources = _variant_sources(graphs)
    assert sources, "no variant was written"
    assert any(".data_ptr()" in s and "_calloc(" in s for s in sources)


def test_each_layout_gets_its_own_variant_and_stays_right(graphs) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(16), torch.randn(16)
    f = _compiled(mixed)
    layouts = [lambda: torch.randn(2, 8, 16),
               lambda: torch.randn(2, 16, 8).transpose(1, 2),  # strided
               lambda: torch.randn(2, 8, 32)[..., ::2]]  # a step along the row
    for make in layouts * 3:
        x = make()
        torch.testing.assert_close(f(x, w, b), mixed(x, w, b))
    assert sum(len(g.variants) for g in graphs if isinstance(g, PlannedGraph)) >= 2


def test_a_training_step_through_written_variants_equals_eager(graphs) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                torch.nn.GELU(), torch.nn.Linear(64, 10))
    compiled = _compiled(model)
    for step in range(4):
        x, y = torch.randn(12, 32), torch.randint(0, 10, (12,))
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        for p, g in zip(model.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, g, msg=f"step {step}")
    planned_graphs = [g for g in graphs if isinstance(g, PlannedGraph)]
    assert len(planned_graphs) == 2  # the forward and the backward
    assert all(g.variants for g in planned_graphs)


def test_an_empty_input_is_planned_without_a_launch(graphs) -> None:
    f = _compiled(lambda x, y: torch.relu(x * y + 1.0))
    for _ in range(4):
        x, y = torch.randn(0, 7), torch.randn(0, 7)
        out = f(x, y)
        assert out.shape == (0, 7)
    launchers = [v for g in graphs for v in _scope(g).values() if isinstance(v, CppLauncher)]
    plans = [p for k in launchers for p in k.cpp_plans.values()]
    assert plans and all(p.ints is None for p in plans)


def _scope(g: Any) -> dict[str, Any]:
    fn = g.fn if isinstance(g, PlannedGraph) else g
    return fn.__globals__


def test_a_launch_of_another_dtype_falls_back_and_learns_no_plan(graphs) -> None:
    f = _compiled(lambda x, y: torch.relu(x * y + 1.0))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    f(x, y)
    (launcher,) = [v for g in graphs for v in _scope(g).values() if isinstance(v, CppLauncher)]
    assert launcher.plan_for((x, y)) is not None
    xd, yd = x.double(), y.double()  # the kernel reads f32: this call runs through ATen
    with pytest.warns(UserWarning, match="runs a call through ATen"):
        out = launcher(xd, yd)
    torch.testing.assert_close(out, torch.relu(xd * yd + 1.0))
    assert launcher.plan_for((xd, yd)) is None
    torch.testing.assert_close(launcher(x, y), torch.relu(x * y + 1.0))


def test_a_launch_that_reads_copies_of_its_inputs_learns_no_plan(graphs, monkeypatch) -> None:
    """A launch passing its kernel other tensors than the inputs (made contiguous
    for a kernel that reads them flat) cannot be replayed on the inputs: that
    signature keeps the full path, and stays right."""
    from rewritec.runtime import launch

    prepare = launch._prepare

    def copying(spec: Any, inputs: Any, out_dtypes: Any) -> Any:
        g, outs, tensors = prepare(spec, inputs, out_dtypes)
        return g, outs, [t.contiguous().clone() for t in tensors]

    monkeypatch.setattr(launch, "_prepare", copying)
    f = _compiled(lambda x, y: torch.relu(x * y + 1.0))
    for _ in range(4):
        x, y = torch.randn(5, 9), torch.randn(5, 9)
        torch.testing.assert_close(f(x, y), torch.relu(x * y + 1.0))
    (launcher,) = [v for g in graphs for v in _scope(g).values() if isinstance(v, CppLauncher)]
    assert launcher.cpp_plans == {}
    assert not _variant_sources(graphs) or not any(".data_ptr()" in s
                                                   for s in _variant_sources(graphs))
