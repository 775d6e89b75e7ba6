"""The backward of GELU's tanh form inside kernels (rules/decompose/activations.yaml:
gelu-backward-tanh, -half): it ran through ATen, outside every kernel, in any training
step of a model using `F.gelu(x, approximate="tanh")`. Differential against eager, on
both targets, several shapes, layouts and dtypes, special values included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report
from rewritec.runtime.build import cxx

TARGETS = [
    pytest.param("triton", id="triton"),
    pytest.param("openmp", id="openmp",
                 marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
]


def _device(target: str) -> str:
    return "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"


def _fired(name: str) -> int:
    return sum(r.rules_fired.get(name, 0) for r in report.RECORDS)


def _outside() -> list[str]:
    return [op for r in report.RECORDS for op in r.fallback_ops if "gelu" in op]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("shape", [(5, 17), (2, 3, 4, 9)])
@pytest.mark.parametrize("transposed", [False, True])
def test_gelu_tanh_gradients_equal_eager(target: str, dtype: torch.dtype, shape: tuple,
                                         transposed: bool) -> None:
    if target == "openmp" and dtype in (torch.bfloat16, torch.float16):
        pytest.skip("the OpenMP target computes f32 and f64 only")
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3.0).to(dtype).to(_device(target))
    if transposed:
        x = x.transpose(0, -1)
    xc, xe = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    fn = lambda t: F.gelu(t * 1.5, approximate="tanh")  # noqa: E731
    report.reset()
    torch._dynamo.reset()
    out = rewritec.compile(fn, target=target, strict=True)(xc)
    ref = fn(xe)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    # eager rounds the backward's result once, from f32, as the -half rule does
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype in (torch.bfloat16, torch.float16) else {}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(xc.grad, xe.grad, **tol)
    half = dtype in (torch.bfloat16, torch.float16)
    assert _fired("gelu-backward-tanh-half" if half else "gelu-backward-tanh") == 1
    assert not _outside(), [dict(r.fallback_ops) for r in report.RECORDS]


@pytest.mark.parametrize("target", TARGETS)
def test_gelu_tanh_gradient_of_special_values(target: str) -> None:
    """nan, infinities and zeros give ATen's gradients (f32 and f64)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-8, -30.0,
                          30.0, 3.0, -3.0], dtype=dtype, device=_device(target))
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch._dynamo.reset()
        fn = lambda t: F.gelu(t, approximate="tanh") * 2.0  # noqa: E731
        rewritec.compile(fn, target=target, strict=True)(xc).sum().backward()
        fn(xe).sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, equal_nan=True)


def test_a_tanh_gelu_mlp_trains_in_kernels_under_autocast() -> None:
    """A Linear + tanh-GELU + Linear block under bf16 autocast: loss and gradients
    equal eager's, and no GELU op runs outside a kernel, forward or backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(64, 32))
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(64, 32))
    ref.load_state_dict(model.state_dict())
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rewritec", options={"strict": True})
    x = torch.randn(8, 16, 32)
    losses = []
    for m in (compiled, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)
    assert _fired("gelu-backward-tanh-half") == 1
    assert not _outside(), [dict(r.fallback_ops) for r in report.RECORDS]
