"""Layer norm's backward written out by rules (rules/decompose/norms.yaml,
layer-norm-backward-*): the input's gradient in a row kernel, the weight's and the
bias's as sums over the rows; no ATen native_layer_norm_backward left. Trained
against eager: residual stream, affine or not, 2-d and 3-d inputs, f32, halves and
autocast, the gradients of the input and of every parameter."""

from __future__ import annotations

import collections

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops
from rewritec import report

DEVICE, TARGETS = kernel_targets()
HALVES = [torch.bfloat16, torch.float16]


class Block(torch.nn.Module):
    def __init__(self, width: int, affine: bool) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width, elementwise_affine=affine)
        self.fc = torch.nn.Linear(width, width)
        if affine:
            torch.nn.init.normal_(self.ln.weight)
            torch.nn.init.normal_(self.ln.bias)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = x + r
        return self.fc(self.ln(h)) + h  # a transformer's pre-norm block


def _grads(model: torch.nn.Module, fn, x: torch.Tensor, r: torch.Tensor, cot: torch.Tensor,
           autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = fn(x, r)
    grads = torch.autograd.grad(out, [x, *model.parameters()], cot)
    return out.detach(), list(grads)


def _check(shape: tuple[int, ...], dtype: torch.dtype, affine: bool, autocast: bool,
           target: str) -> collections.Counter[str]:
    torch.manual_seed(len(shape) + shape[-1])
    model = Block(shape[-1], affine).to(DEVICE)
    if not autocast:
        model.to(dtype)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    r = torch.randn(shape, device=DEVICE, dtype=dtype)
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rewritec",
                             options={"target": target, "strict": True})
    cot = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16 if autocast else dtype)
    want, ref = _grads(model, model, x, r, cot, autocast)
    got, mine = _grads(model, compiled, x, r, cot, autocast)
    half = dtype != torch.float32 or autocast
    tol = 2e-2 if half else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(mine, ref, strict=True):
        # a product's gradient in half rounds apart near zero: scaled by its largest
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * max(1.0, float(w.abs().max())))
    return outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 64)], ids=str)
def test_layer_norm_backward_in_kernels_f32(shape, affine: bool, target: str) -> None:
    outside = _check(shape, torch.float32, affine, False, target)
    assert "native_layer_norm_backward" not in outside and "native_layer_norm" not in outside
    # x^ = (x - mean) * rstd, which the weight's gradient reads too, is computed again
    # by its sum over the rows (engine/fuse.py: _recompute_side_outputs), not written
    # by the row kernel of the input's gradient
    (backward,) = [r for r in report.RECORDS if r.kind == "backward"]
    rows = [k for k in backward.kernels if k["rules"] == ["fuse-row"]]
    assert [k["outputs"] for k in rows] == [1]
    if affine:
        assert any(k["ops"].get("sub", 0) and k["ops"].get("sum", 0)
                   for k in backward.kernels if k["rules"] == ["fuse-reduction"])


@pytest.mark.skipif("triton" not in TARGETS, reason="halves compute in Triton kernels only")
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 64)], ids=str)
def test_layer_norm_backward_in_kernels_half(shape, affine: bool, dtype: torch.dtype) -> None:
    outside = _check(shape, dtype, affine, False, "triton")
    assert "native_layer_norm_backward" not in outside and "native_layer_norm" not in outside


@pytest.mark.skipif("triton" not in TARGETS, reason="halves compute in Triton kernels only")
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 64)], ids=str)
def test_layer_norm_backward_under_autocast(shape) -> None:
    outside = _check(shape, torch.float32, True, True, "triton")
    assert "native_layer_norm_backward" not in outside


def test_layer_norm_backward_over_two_dims() -> None:
    """normalized_shape of two dims: rows are the dims before them."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm([3, 8]).to(DEVICE)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x = torch.randn(5, 3, 8, device=DEVICE)
    cot = torch.randn(5, 3, 8, device=DEVICE)
    report.reset()
    torch._dynamo.reset()
    target = TARGETS[0] if TARGETS else "aten"
    compiled = torch.compile(ln, backend="rewritec", options={"target": target, "strict": True})
    mine = torch.autograd.grad(compiled(x.requires_grad_()), [x, *ln.parameters()], cot)
    ref = torch.autograd.grad(ln(x), [x, *ln.parameters()], cot)
    for g, w in zip(mine, ref, strict=True):
        torch.testing.assert_close(g, w)
    if TARGETS:
        assert all("native_layer_norm_backward" not in r.fallback_ops for r in report.RECORDS)
