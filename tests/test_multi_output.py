"""Multi-output kernels (engine/fuse.py: side outputs) against eager.

A producer that users outside its group also read (or that the graph returns)
joins the group and the kernel writes it out too: a residual add feeding a
layer_norm and the caller, an intermediate of a pointwise chain that is also
returned, layer_norm's mean and rstd saved for the backward. Each case checks
the values (forward and backward), that the expected kernels with the expected
number of outputs were made, and what stays on ATen; others check that fusion
never makes a cycle and that a kernel that fails falls back with every output."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report
from rewritec.kinds import kernels
from rewritec.runtime import launch
from rewritec.runtime.build import cxx
from rewritec.runtime.launch import KernelFallback
from rewritec.engine.fuse import body_terms, fuse
from rewritec.kinds.registry import SPACES
from rewritec.engine.ops import default_op_table
from rewritec.engine.term import Graph, Meta, TermStore
from rewritec.rulesets import builtin_rules

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TARGETS = [
    pytest.param("openmp", marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
]
HALF = [torch.bfloat16, torch.float16]
needs_triton = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")


def residual_layer_norm(x, r, w, b):
    """The transformer block's residual stream: y feeds the layer_norm and the caller."""
    y = x + r
    return y, F.layer_norm(y, y.shape[-1:], w, b)


def chain(x, y):
    """A pointwise chain whose intermediate is returned too."""
    a = torch.exp(x) * y
    return a, torch.tanh(a) + 1.0


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, transposed: bool = False):
    x = torch.randn(shape[::-1]).t() if transposed else torch.randn(shape)
    return [x.to(dtype), torch.randn(shape).to(dtype), torch.randn(shape[-1:]).to(dtype),
            torch.randn(shape[-1:]).to(dtype)]


def _compile_and_check(fn, target: str, inputs: list[torch.Tensor], grad: bool = False,
                       tol: float | None = None) -> list[dict]:
    """fn compiled (strict: no fallback) against eager, forward and (grad) the
    gradients of every input; returns the kernels' report records."""
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rewritec", options={"target": target, "strict": True})
    kw = {"rtol": tol, "atol": tol} if tol else {}
    if not grad:
        for got, want in zip(compiled(*inputs), fn(*inputs), strict=True):
            torch.testing.assert_close(got, want, **kw)
    else:
        mine = [x.detach().clone().requires_grad_(True) for x in inputs]
        ref = [x.detach().clone().requires_grad_(True) for x in inputs]
        got, want = compiled(*mine), fn(*ref)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **kw)
        cots = [torch.randn_like(w) for w in want]
        for g, w in zip(torch.autograd.grad(got, mine, cots),
                        torch.autograd.grad(want, ref, cots), strict=True):
            torch.testing.assert_close(g, w, **kw)
    return [k for r in report.RECORDS for k in r.kernels]


def _outputs(records: list[dict]) -> list[int]:
    return sorted(k["outputs"] for k in records)


# ------------------------------------------------------------------ residual + layer_norm
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shape", "transposed"), [
    ((6, 37), False), ((6, 37), True), ((2, 3, 64), False), ((3, 5000), False),
    ((3, 5000), True)], ids=str)
def test_residual_layer_norm(target: str, shape: tuple[int, ...], transposed: bool) -> None:
    records = _compile_and_check(residual_layer_norm, target,
                                 _inputs(shape, torch.float32, transposed))
    # one row kernel writes y and the layer_norm's output
    assert _outputs(records) == [2]
    assert all(k["rules"] == ["fuse-row"] for k in records)


@pytest.mark.parametrize("target", TARGETS)
def test_residual_layer_norm_backward(target: str) -> None:
    records = _compile_and_check(residual_layer_norm, target, _inputs((5, 19), torch.float32),
                                 grad=True)
    forward = report.RECORDS[0]
    assert forward.kind == "forward" and "native_layer_norm" not in forward.fallback_ops
    # y, the output, the mean and the rstd (saved for the backward): one kernel
    assert [k["outputs"] for k in forward.kernels] == [4]
    assert records


@needs_triton
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", [(6, 40), (2, 3000)], ids=str)
def test_residual_layer_norm_half(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    records = _compile_and_check(residual_layer_norm, "triton", _inputs(shape, dtype), tol=2e-2)
    # the row kernel writes y beside the layer_norm, and casts the weight and bias to
    # f32 where it reads them (kinds/row.py: values that broadcast to the rows)
    assert _outputs(records) == [2]


# ------------------------------------------------------------------ pointwise chains
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(5, 9), (1023,), (4, 6, 7)], ids=str)
def test_pointwise_intermediate_returned(target: str, shape: tuple[int, ...]) -> None:
    x, y = torch.randn(shape), torch.randn(shape[-1:])
    records = _compile_and_check(chain, target, [x, y])
    assert _outputs(records) == [2]


@pytest.mark.parametrize("target", TARGETS)
def test_pointwise_chain_backward(target: str) -> None:
    _compile_and_check(chain, target, [torch.randn(7, 13), torch.randn(13)], grad=True)
    forward = report.RECORDS[0]
    assert forward.kernels and not forward.fallback_ops


@needs_triton
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_pointwise_intermediate_half(dtype: torch.dtype) -> None:
    x, y = torch.randn(6, 33).to(dtype), torch.randn(33).to(dtype)
    records = _compile_and_check(chain, "triton", [x, y], tol=2e-2)
    assert _outputs(records) == [2]


@pytest.mark.parametrize("target", TARGETS)
def test_pointwise_intermediate_strided_input(target: str) -> None:
    x = torch.randn(9, 5).t()  # read strided, written in the root's layout
    records = _compile_and_check(chain, target, [x, torch.randn(9)])
    assert _outputs(records) == [2]


# ------------------------------------------------------------------ other row kernels
def row_sum_and_terms(x, y):
    """A row reduction (the root, one value per row) and the values it sums."""
    a = torch.exp(x) * y
    return a.sum(-1, keepdim=True), a


def softmax_dim0_and_input(x, y):
    """Rows along dim 0 (the kernel's layout is permuted), the input also returned."""
    a = x * y
    return a, F.softmax(a, dim=0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fn", [row_sum_and_terms, softmax_dim0_and_input],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(5, 17), (3, 5000)], ids=str)
def test_row_kernels_with_side_outputs(target: str, fn, shape: tuple[int, ...]) -> None:
    if fn is softmax_dim0_and_input:
        shape = shape[::-1]  # the long dim is the reduced one
    # a sum of 5000 terms, accumulated in another order than ATen's (and closer to
    # the float64 sum: tests/test_reduction_accuracy.py)
    tol = 1e-4 if max(shape) > 1000 else None
    records = _compile_and_check(fn, target, [torch.randn(shape), torch.randn(shape[-1])],
                                 tol=tol)
    assert _outputs(records) == [2]


def layout_change(x):
    """NHWC read, NCHW written (Triton: the tiled pointwise template), twice."""
    z = torch.sin(x).contiguous()
    return z, torch.tanh(z) + 1.0


@pytest.mark.parametrize("target", TARGETS)
def test_layout_change_with_a_side_output(target: str) -> None:
    x = torch.randn(2, 16, 16, 24).permute(0, 3, 1, 2)
    records = _compile_and_check(layout_change, target, [x])
    assert _outputs(records) == [2]
    if target == "triton":
        assert records[0]["template"] == "triton/pointwise_tiled"


# ------------------------------------------------------------------ layer_norm in training
def _layer_norm_training(target: str, dtype: torch.dtype, shape: tuple[int, ...],
                         tol: float | None) -> None:
    torch._dynamo.reset()
    report.reset()
    ln = torch.nn.LayerNorm(shape[-1]).to(dtype)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x = torch.randn(shape).to(dtype).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled = torch.compile(ln, backend="rewritec", options={"target": target, "strict": True})
    got, want = compiled(x), ln(x_ref)
    kw = {"rtol": tol, "atol": tol} if tol else {}
    torch.testing.assert_close(got, want, **kw)
    cot = torch.randn_like(want)
    params = list(ln.parameters())
    mine = torch.autograd.grad(got, [x, *params], cot)
    ref = torch.autograd.grad(want, [x_ref, *params], cot)
    for g, w in zip(mine, ref, strict=True):
        torch.testing.assert_close(g, w, **kw)
    forward = report.RECORDS[0]
    assert forward.kind == "forward"
    # the output, mean and rstd in one row kernel; ATen's layer_norm is gone (a half
    # weight and bias are cast to f32 by kernels of their own: fuse-pointwise)
    assert [k["outputs"] for k in forward.kernels if k["ops"] != {"to": 1}] == [3]
    assert "native_layer_norm" not in forward.fallback_ops
    assert {"layer-norm-mean", "layer-norm-rstd"} <= set(forward.rules_fired)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(6, 37), (2, 3, 64), (2, 5000)], ids=str)
def test_layer_norm_training(target: str, shape: tuple[int, ...]) -> None:
    _layer_norm_training(target, torch.float32, shape, None)


@needs_triton
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_norm_training_half(dtype: torch.dtype) -> None:
    # mean and rstd are rounded to the input's dtype on the CPU (ATen's too), which
    # the backward amplifies where the row's gradient cancels
    _layer_norm_training("triton", dtype, (6, 40), 5e-2)


def test_layer_norm_mean_and_rstd_match_aten() -> None:
    """layer-norm-mean and layer-norm-rstd give native_layer_norm's shapes, dtypes
    and values, the normalized dims kept as size 1."""
    x = torch.randn(2, 3, 8)

    def f(x):
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [3, 8], None, None, 1e-5)
        return mean * 1.0, rstd * 1.0

    got = rewritec.compile(f, target="aten", strict=True)(x)
    for g, w in zip(got, f(x), strict=True):
        assert g.shape == w.shape == (2, 1, 1) and g.dtype == w.dtype
        torch.testing.assert_close(g, w)
    assert {"layer-norm-mean", "layer-norm-rstd"} <= set(report.RECORDS[-1].rules_fired)


# ------------------------------------------------------------------ no cycles
def _no_cycle_a(x, w):
    """a = x * 2 is read by the group rooted at relu and by a matrix product that
    feeds that group: a joining it as a side output would make a cycle."""
    a = x * 2.0
    return a, torch.relu(a + a @ w) * 3.0


def _no_cycle_b(x1, x2):
    """Two groups that could each take a side output the other reads: c1's kernel
    a1 (for c2), c2's kernel a2 (for c1, through a view, which stays on ATen). Only
    one of them may, or each kernel would need the other's output; the other
    producer stays outside both (neither fits the other group's shape)."""
    a1 = torch.sin(x1)
    a2 = torch.exp(x2)
    c1 = (a1 + a2.view(-1)) * 2.0
    c2 = a2 * a1 - 1.0
    return c1, c2


@pytest.mark.parametrize("target", TARGETS)
def test_no_cycle_through_an_outside_user(target: str) -> None:
    records = _compile_and_check(_no_cycle_a, target, [torch.randn(6, 6), torch.randn(6, 6)])
    # a, in a kernel of its own, not a side output of relu's
    assert "mul" not in report.RECORDS[0].fallback_ops
    assert sorted((k["ops"].get("relu", 0), k["outputs"]) for k in records) == [(0, 1), (1, 1)]


@pytest.mark.parametrize("target", TARGETS)
def test_no_cycle_between_groups(target: str) -> None:
    records = _compile_and_check(_no_cycle_b, target, [torch.randn(7), torch.randn(1, 7)])
    left = report.RECORDS[0].fallback_ops
    assert "sin" not in left and "exp" not in left
    # a1 or a2 in neither group's kernel: one of its own. The other, a side output
    # of one group that the other read, is computed again by the reader instead
    # (engine/fuse.py: _recompute_side_outputs): no kernel writes two outputs
    assert _outputs(records) == [1, 1, 1]
    assert [k["ops"] for k in records if len(k["ops"]) == 1] in ([{"sin": 1}], [{"exp": 1}])
    assert sum(k["ops"].get("sin", 0) + k["ops"].get("exp", 0) for k in records) == 3


def _engine_graph() -> tuple[Graph, TermStore]:
    """_no_cycle_b as terms, for the engine alone."""
    store = TermStore()

    def meta(*shape: int) -> Meta:
        return Meta(shape=shape, strides=(7, 1)[-len(shape):])

    x1 = store.make("input", (), {"name": "x1", "index": 0}, meta=meta(7))
    x2 = store.make("input", (), {"name": "x2", "index": 1}, meta=meta(1, 7))
    a1 = store.make("sin", [x1], meta=meta(7))
    a2 = store.make("exp", [x2], meta=meta(1, 7))
    v = store.make("view", [a2], {"size": (-1,)}, meta=meta(7))
    c1 = store.make("mul", [store.make("add", [a1, v], {"alpha": 1}, meta=meta(7)),
                            store.const(2.0)], meta=meta(7))
    c2 = store.make("sub", [store.make("mul", [a2, a1], meta=meta(1, 7)), store.const(1.0)],
                    {"alpha": 1}, meta=meta(1, 7))
    return Graph((x1, x2), (c1, c2)), store


def test_fused_graph_keeps_kernels_acyclic() -> None:
    graph, store = _engine_graph()
    rules = [r for r in builtin_rules() if r.kind == "fuse"]
    fused, fired = fuse(graph, store, default_op_table(), rules, can_compile=lambda t: True,
                        spaces=SPACES)
    kernel_terms = [t for t in fused.terms() if t.op == "kernel"]
    assert sum(fired.values()) == len(kernel_terms) == 3
    # sin or exp stays outside both groups, a kernel of its own; the other is a side
    # output of one group that the other group computes again: one output each
    assert all(k.meta.kind == "tensor" for k in kernel_terms)
    bodies = Counter(t.op for k in kernel_terms for t in body_terms(k))
    assert bodies["sin"] + bodies["exp"] == 3
    # each kernel reads only the graph's inputs and the other kernels' outputs
    counts = fused.op_counts()
    assert counts.get("sin", 0) + counts.get("exp", 0) == 0
    for k in kernel_terms:
        for a in k.args:
            assert a.op in ("input", "kernel", "view", "getitem"), a


# ------------------------------------------------------------------ users as outputs
def siblings(x):
    """a = x * 2 feeds the root's chain and a * 3: the kernel rooted at exp(a) + 1
    takes a in, then a * 3 (computed from a alone) as its second output."""
    a = x * 2.0
    return torch.exp(a) + 1.0, a * 3.0


@pytest.mark.parametrize("target", TARGETS)
def test_a_user_of_members_becomes_an_output(target: str) -> None:
    records = _compile_and_check(siblings, target, [torch.randn(4, 9)])
    assert _outputs(records) == [2]
    assert not report.RECORDS[0].fallback_ops


# ------------------------------------------------------------------ falling back
@pytest.mark.parametrize("target", TARGETS)
def test_launch_failure_falls_back_with_every_output(target: str, monkeypatch) -> None:
    def broken(self, *inputs):
        raise RuntimeError("simulated launch failure")

    cls = launch.CppLauncher if target == "openmp" else launch.TritonLauncher
    monkeypatch.setattr(cls, "launch", broken)
    for fn, inputs in [(residual_layer_norm, _inputs((4, 9), torch.float32)),
                       (siblings, [torch.randn(4, 9)])]:
        torch._dynamo.reset()
        report.reset()
        with pytest.warns(KernelFallback, match="failed at launch.*simulated launch failure"):
            got = rewritec.compile(fn, target=target)(*inputs)
        for g, w in zip(got, fn(*inputs), strict=True):
            torch.testing.assert_close(g, w)
        assert report.RECORDS[0].status == "compiled"
        assert _outputs([k for r in report.RECORDS for k in r.kernels]) == [2]


@pytest.mark.parametrize("target", TARGETS)
def test_build_failure_falls_back_with_every_output(target: str, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise kernels.RenderError("simulated render failure")

    monkeypatch.setattr(kernels, "value_expr", broken)
    for fn, inputs in [(chain, [torch.randn(5, 9), torch.randn(9)]),
                       (siblings, [torch.randn(4, 9)])]:
        torch._dynamo.reset()
        report.reset()
        with pytest.warns(KernelFallback, match="simulated render failure"):
            got = rewritec.compile(fn, target=target)(*inputs)
        for g, w in zip(got, fn(*inputs), strict=True):
            torch.testing.assert_close(g, w)
        # the group runs on ATen, the rest of the graph as compiled
        assert report.RECORDS[0].status == "compiled" and not report.RECORDS[0].kernels


# ------------------------------------------------------------------ the graph cache
@pytest.mark.parametrize("target", TARGETS)
def test_graph_cache_loads_a_multi_output_kernel(target: str, tmp_path, monkeypatch,
                                                  aot_calls) -> None:
    """The spec a cache entry keeps (for_launch) carries every output."""
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REWRITEC_GRAPH_CACHE", "1")
    inputs = _inputs((6, 40), torch.float32)
    results = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(residual_layer_norm, backend="rewritec",
                                 options={"target": target, "strict": True})
        with torch.no_grad():
            results.append(compiled(*inputs))
    for got in results:
        for g, w in zip(got, residual_layer_norm(*inputs), strict=True):
            torch.testing.assert_close(g, w)
    assert len(aot_calls) == 1, "the second compile went through AOTAutograd"
    cold, warm = report.RECORDS
    assert (cold.cached, warm.cached) == (False, True)
    assert [k["outputs"] for k in warm.kernels] == [2]
