"""ATen's type promotion written out (rules/decompose/promotion.yaml): an integer tensor
in arithmetic with a float tensor is converted to the float's dtype first, so kernels
compute the op (they combine integers with integers only) instead of ATen. Results
and dtypes equal eager's on both targets, for several integer and float dtypes;
log-sigmoid's backward (whose decomposition multiplies an int64 `where` by floats)
runs inside kernels; so does an integer tensor with a Python float, or divided by any
number (its result the default float dtype), exact against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import check_grad, target_device, target_params

import rewritec
from rewritec import report

TARGETS = target_params()


def mixed(i: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (i * y + 1.0, y - i, (i - y) * 2.0, i / (y.abs() + 1.0), y / (i.abs() + 1),
            torch.add(y, i, alpha=3), torch.where(y > 0, 1, -1) * y)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("fdtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_mixed_integer_float_arithmetic_in_kernels_equals_eager(
        target: str, idtype: torch.dtype, fdtype: torch.dtype) -> None:
    if target == "openmp" and fdtype == torch.bfloat16:
        pytest.skip("the OpenMP target computes f32 and f64 only")
    torch.manual_seed(0)
    dev = target_device(target)
    i = torch.randint(-50, 50, (6, 37), dtype=idtype, device=dev)
    y = (torch.randn(6, 37) * 4.0).to(fdtype).to(dev)
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(mixed, target=target, strict=True)(i, y)
    want = mixed(i, y)
    tol = {"rtol": 2e-2, "atol": 2e-1} if fdtype == torch.bfloat16 else {}
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)
    outside = [dict(r.fallback_ops) for r in report.RECORDS if r.fallback_ops]
    assert not any(op in ("mul", "sub", "div", "add") for o in outside for op in o), outside


@pytest.mark.parametrize("target", TARGETS)
def test_log_sigmoid_gradient_runs_in_kernels(target: str) -> None:
    torch.manual_seed(0)
    report.reset()
    check_grad(lambda t: (F.logsigmoid(t) * 1.5).sum(),
               (torch.randn(5, 17) * 4.0).to(target_device(target)), target)
    (backward,) = [r for r in report.RECORDS if r.kind == "backward"]
    assert not {"mul", "sub"} & set(backward.fallback_ops), backward.fallback_ops


def test_an_integer_times_a_python_float_stays_exact_and_float32() -> None:
    i = torch.arange(-20, 20, dtype=torch.int64) * 1_000_003
    fn = lambda t: (t * 0.5, t * 2 + 1)  # noqa: E731
    torch._dynamo.reset()
    got = rewritec.compile(fn, target="openmp", strict=True)(i)
    for g, w in zip(got, fn(i), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_an_integer_with_a_python_float_runs_in_kernels(target, idtype) -> None:
    """Past 2**24 the conversion to f32 rounds, in the kernel as in eager."""
    device = target_device(target)
    i = (torch.arange(-20, 20, dtype=torch.int64) * 1_000_003).to(idtype).to(device)
    y = torch.randn(40, device=device)

    def fn(t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sub = (t - 1.5) * y if t.dtype != torch.bool else y  # (ATen refuses `-` on bools)
        return (t * 0.5 + y, (t + 0.25) * y, sub, t / 3 + y, 2.5 * t - y)

    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(i, y)
    for g, w in zip(got, fn(i, y), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    outside = {op for r in report.RECORDS for op in r.fallback_ops}
    assert not {"mul", "add", "sub", "div"} & outside, outside

