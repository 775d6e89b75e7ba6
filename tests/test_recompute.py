"""Recomputed producers (engine/fuse.py: `recomputable`) against eager.

A cheap pointwise producer that several kernels read, and that no kernel can
write out for the others (a reduction takes no side outputs, and a pointwise
consumer of the reductions would close a cycle), is computed again inside each
kernel instead of running as its own ATen call: batch_norm's backward reads
relu's gradient and x - mean in two reductions and in the input gradient. Each
case checks values forward and backward, over shapes, strides and dtypes, and
that the shared producer no longer runs on ATen."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rewritec import report
from rewritec.runtime.build import cxx

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TARGETS = [
    pytest.param("openmp", marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
]


def _fallbacks(start: int, kind: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in report.RECORDS[start:]:
        if r.kind == kind:
            for op, n in r.fallback_ops.items():
                out[op] = out.get(op, 0) + n
    return out


def _check(fn, inputs: list[torch.Tensor], target: str, tol: float | None = None,
           grad_tol: tuple[float, float] | None = None) -> int:
    """fn compiled (strict) against eager, values and gradients of every input;
    returns where its report records start."""
    start = len(report.RECORDS)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rewritec", options={"target": target, "strict": True})
    mine = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    got, want = compiled(*mine), fn(*ref)
    kw = {"rtol": tol, "atol": tol} if tol else {}
    torch.testing.assert_close(got, want, **kw)
    cot = torch.randn_like(want)
    if grad_tol:
        kw = {"rtol": grad_tol[0], "atol": grad_tol[1]}
    wrt = [(m, r) for m, r in zip(mine, ref, strict=True) if m.requires_grad]
    for g, w in zip(torch.autograd.grad(got, [m for m, _ in wrt], cot),
                    torch.autograd.grad(want, [r for _, r in wrt], cot), strict=True):
        torch.testing.assert_close(g, w, **kw)
    return start


def shared_relu_grad(x, w):
    """relu's output read by two reductions and by the caller: its gradient is
    what batch_norm's backward reads three times."""
    y = F.relu(x * w)
    return y * (y.sum(dim=(0, 2), keepdim=True) + y.mean(dim=(0, 2), keepdim=True))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shape", "transposed", "dtype"), [
    ((4, 8, 6), False, torch.float32), ((3, 5, 17), True, torch.float32),
    ((2, 16, 9), False, torch.float64)], ids=str)
def test_shared_pointwise_producer_is_recomputed(target, shape, transposed, dtype) -> None:
    x = torch.randn(shape[::-1]).permute(2, 1, 0) if transposed else torch.randn(shape)
    w = torch.randn(shape[1], 1)
    _check(shared_relu_grad, [x.to(dtype), w.to(dtype)], target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("n", "c", "hw"), [(4, 8, 5), (2, 3, 7)])
def test_batch_norm_backward_reads_no_aten_pointwise(target, n, c, hw) -> None:
    """conv, batch_norm (training) and relu twice: the backward's relu gradient and
    x - mean are computed inside the kernels that read them."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                      nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()).train()
    start = _check(lambda x: m(x), [torch.randn(n, 3, hw, hw)], target, tol=1e-4)
    outside = _fallbacks(start, "backward")
    assert "threshold_backward" not in outside, outside
    assert "sub" not in outside, outside


@pytest.mark.parametrize("target", TARGETS)
def test_recomputing_a_chain_keeps_half_precision(target) -> None:
    """A shared chain of casts and pointwise ops under bf16: recomputed, it rounds
    where eager rounds."""
    def fn(x, w):
        y = torch.tanh(x.to(torch.bfloat16) * w).float()
        return y * y.sum(dim=0, keepdim=True) + y.mean(dim=0, keepdim=True)

    x, w = torch.randn(33, 20), torch.randn(20).to(torch.bfloat16)
    # the gradients sum 33 rows of bf16 tanh gradients (magnitude ~20): eager rounds
    # each product to bf16, the kernel once
    _check(fn, [x, w], target, tol=2e-2, grad_tol=(3e-2, 0.3))
