"""A mean's gradient, expand(g, s) / n, no longer splits a backward in two.

RMSNorm written as models write it (HF's Llama and T5: `h.pow(2).mean(-1,
keepdim=True)`) differentiates the mean into an expand of one value per row and a
division; the expand, a view ATen ran between two kernels, left the input's
gradient as a reduction kernel and a pointwise one. rules/simplify/views.yaml
(expand-div-scalar, mul-expand, add-expand, sub-expand, sub-of-expand) lets the
pointwise ops broadcast the row's value themselves: the input's gradient is one row
kernel. Against eager over shapes, dtypes, autocast and both targets, forward and
backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import check_block_under_autocast, kernel_targets, outside_ops, rules_fired
from rewritec import report

DEVICE, TARGETS = kernel_targets()


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm, written out."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class Centered(nn.Module):
    """x - mean(x), scaled by a mean of squares: both gradients pass an expand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x - x.mean(-1, keepdim=True)
        return c / (c * c).mean(-1, keepdim=True).add(1e-5).sqrt()


def _grads(fn, x: torch.Tensor, cot: torch.Tensor, params: list[torch.Tensor]):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    return [out.detach(), *torch.autograd.grad(out, [x, *params], cot)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4, 8, 64), (3, 33), (2, 5, 7, 16)], ids=str)
@pytest.mark.parametrize("make", [RMSNorm, Centered], ids=["rmsnorm", "centered"])
def test_mean_backward_is_one_row_kernel(make, shape, dtype, target) -> None:
    torch.manual_seed(shape[-1])
    model = make(shape[-1]) if make is RMSNorm else make()
    model = model.to(DEVICE)
    params = list(model.parameters())
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    cot = torch.randn(shape, device=DEVICE, dtype=dtype)
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rewritec",
                             options={"target": target, "strict": True})
    got = _grads(compiled, x, cot, params)
    want = _grads(model, x, cot, params)
    tol = {} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
    assert "expand" not in outside_ops()
    if target == "openmp" and dtype == torch.float16 and make is Centered:
        return  # f16 arithmetic stays ATen's on the CPU (tests/test_cpu_halves.py)
    (backward,) = [r for r in report.RECORDS if r.kind == "backward"]
    # the input's gradient: one row kernel (the weight's, a sum over rows, another)
    rows = [k for k in backward.kernels if "_fuse_row" in k["name"]]
    assert len(rows) == 1, [k["name"] for k in backward.kernels]
    assert rules_fired()["mul-expand"] >= 1


def test_rmsnorm_block_under_autocast() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = RMSNorm(32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(self.norm(x))

    torch.manual_seed(0)
    check_block_under_autocast(Block, torch.randn(2, 6, 32))
    assert "expand" not in outside_ops()
