"""clamp, hardswish, hardsigmoid and ReLU6 inside kernels: rules/decompose/activations.yaml
writes clamp as clamp_min / clamp_max (rules/ops.yaml), whose kernel expressions must
agree with ATen on nan, infinities, signed zeros and an empty range (lo > hi gives hi),
forward and backward, on both targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewritec
from models import target_device, with_values
from rewritec import report
from rewritec.runtime.build import cxx

TARGETS = [
    pytest.param("triton", id="triton"),
    pytest.param("openmp", id="openmp",
                 marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
]
FUNCS = {
    "clamp": lambda x: torch.clamp(x * 2.0, -1.5, 2.5),
    "clamp_min": lambda x: torch.clamp(x + 1.0, min=0.0) * 3.0,
    "clamp_max": lambda x: torch.clamp(x - 1.0, max=0.5) * 3.0,
    "empty_range": lambda x: torch.clamp(x * 1.0, 1.0, -1.0),
    "hardswish": lambda x: F.hardswish(x) * 2.0,
    "hardsigmoid": lambda x: F.hardsigmoid(x) - x,
    "relu6": lambda x: F.relu6(x) + 1.0,
}


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0, -3.0, 6.0, 1.0, -1.0]


def _special(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return with_values(shape, dtype, SPECIAL, scale=4.0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_clamps_in_kernels_equal_eager(target: str, name: str, dtype: torch.dtype) -> None:
    if target == "openmp" and dtype in (torch.bfloat16, torch.float16):
        pytest.skip("the OpenMP target computes f32 and f64 only")
    fn = FUNCS[name]
    x = _special((7, 33), dtype).to(target_device(target))
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    want = fn(x)
    # eager rounds after each half-precision op, kernels once at the end
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype in (torch.bfloat16, torch.float16) else {}
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    # signed zeros as ATen gives them
    zeros = want == 0
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(want[zeros]))
    fused = [k for r in report.RECORDS for k in r.kernels]
    assert fused and not any(op.startswith("clamp") for r in report.RECORDS
                             for op in r.fallback_ops), [dict(r.fallback_ops)
                                                         for r in report.RECORDS]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["clamp", "hardswish", "hardsigmoid", "relu6"])
@pytest.mark.parametrize("shape", [(5, 17), (2, 3, 4, 9)])
def test_clamp_gradients_equal_eager(target: str, name: str, shape: tuple) -> None:
    fn = FUNCS[name]
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 4.0).to(target_device(target))
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    out = rewritec.compile(fn, target=target, strict=True)(xc)
    ref = fn(xe)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xc.grad, xe.grad)


def test_integer_clamp_stays_exact() -> None:
    """Kernels compute floats only: an integer clamp is left to ATen, and exact."""
    x = torch.arange(-50, 50, dtype=torch.int64) * 1_000_000_007
    fn = lambda x: torch.clamp(x, -3_000_000_000, 7) + 1  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(rewritec.compile(fn, strict=True)(x), fn(x))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=str)
def test_relu_keeps_zeros_and_nan_as_aten_does(target: str, dtype: torch.dtype) -> None:
    """relu(-0.0) is -0.0 in ATen's CPU kernel (a clamp_min that keeps what is not
    below 0); a kernel's relu gives the same zeros and nan on the device it runs on
    (Triton's is checked against eager on a GPU only: the interpreter's maximum
    orders the zeros as NumPy does)."""
    if target == "triton" and not torch.cuda.is_available():
        pytest.skip("Triton's relu is checked against CUDA eager")
    x = _special((7, 33), torch.float32)
    x = (x if dtype.is_floating_point else x.nan_to_num(0.0).clamp(-100, 100)).to(dtype)
    x = x.to(target_device(target))

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(t) * 1) * 1

    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    want = fn(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    if dtype.is_floating_point:
        assert torch.equal(torch.signbit(got), torch.signbit(want))


# --------------------------------------------------------------------------- tensor bounds
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bound", ["0-d", "row", "full"])
def test_a_tensor_bound_is_maximum_or_minimum_in_kernels(target, dtype, bound) -> None:
    """clamp_min / clamp_max with a tensor bound (rules/decompose/activations.yaml:
    clamp-min-tensor, clamp-max-tensor): nan and infinities of either side as ATen."""
    if target == "openmp" and dtype == torch.bfloat16:
        pytest.skip("the OpenMP target computes f32 and f64 only")
    device = target_device(target)
    x = _special((7, 33), dtype).to(device)
    shape = {"0-d": (), "row": (33,), "full": (7, 33)}[bound]
    lo = _special(shape, dtype).to(device) if shape else torch.tensor(0.5, dtype=dtype,
                                                                       device=device)
    hi = lo.flip(-1) + 1.0 if shape else torch.tensor(2.0, dtype=dtype, device=device)

    def fn(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return torch.clamp_max(torch.clamp_min(x * 2.0, lo), hi) + 1.0

    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x, lo, hi)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, fn(x, lo, hi), equal_nan=True, **tol)
    assert not any(op.startswith("clamp") for r in report.RECORDS for op in r.fallback_ops)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(6, 16), (2, 5, 8)], ids=str)
def test_cosine_similarity_in_kernels_forward_and_backward(target, shape) -> None:
    """F.cosine_similarity clamps its norms' product with a 0-d tensor bound."""
    torch.manual_seed(0)
    device = target_device(target)
    a, b = torch.randn(*shape).to(device), torch.randn(*shape).to(device)
    a[0] = 0.0  # a zero vector: the clamp to eps decides the value
    fn = lambda a, b: F.cosine_similarity(a, b, dim=-1)  # noqa: E731
    ac, ae = a.clone().requires_grad_(), a.clone().requires_grad_()
    report.reset()
    torch._dynamo.reset()
    out = rewritec.compile(fn, target=target, strict=True)(ac, b)
    ref = fn(ae, b)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(ac.grad, ae.grad)
    assert not any(op.startswith("clamp") for r in report.RECORDS for op in r.fallback_ops), \
        [dict(r.fallback_ops) for r in report.RECORDS]
