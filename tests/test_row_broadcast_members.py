"""Row kernels compute values that broadcast to their rows (kinds/row.py
RowSpace.fits): a half layer norm's f32 casts of its [D] weights, a bias
transformed before it is added, a [1, T, D] position table cast to the input's
dtype. Each was a kernel of its own, launched before the row kernel read its
result (a bf16 ViT-B/16's inference ran 50 such cast kernels a step against 40
row and pointwise kernels). Differential against eager, one kernel each."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import kernel_targets, outside_ops, tol
from rewritec import report
from test_kernels import _check

DEVICE, TARGETS = kernel_targets()
VIEWS = {"view", "reshape", "expand", "t", "permute", "unsqueeze", "_unsafe_view", "squeeze"}


def _one_kernel(fn, target: str, *inputs: torch.Tensor, dtype: torch.dtype) -> None:
    _check(fn, target, *inputs, tol=tol(dtype)["rtol"])  # against eager
    kernels = [k for r in report.RECORDS for k in r.kernels]
    assert len(kernels) == 1, [k["ops"] for k in kernels]
    assert not set(outside_ops()) - VIEWS, outside_ops()


def _half_ok(target: str, dtype: torch.dtype) -> None:
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("OpenMP kernels compute no f16")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4, 9, 64), (3, 130), (2, 2500)], ids=str)  # 2500: looped
def test_half_layer_norm_casts_its_weights_inside_the_row_kernel(target, dtype, shape) -> None:
    _half_ok(target, dtype)
    torch.manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = (torch.rand(d, device=DEVICE) + 0.5).to(dtype)
    b = torch.randn(d, device=DEVICE, dtype=dtype)
    _one_kernel(lambda x, w, b: F.layer_norm(x, (d,), w, b, eps=1e-6), target, x, w, b,
                dtype=dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("d", [33, 2500])
def test_softmax_of_a_transformed_bias(target, d) -> None:
    torch.manual_seed(0)
    x, bias = torch.randn(6, d, device=DEVICE), torch.randn(d, device=DEVICE)
    _one_kernel(lambda x, b: F.softmax(x + torch.exp(b) * 0.5, dim=-1), target, x, bias,
                dtype=torch.float32)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_norm_of_a_cast_position_table(target, dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 7, 48, device=DEVICE, dtype=dtype)
    pos = torch.randn(1, 7, 48, device=DEVICE)  # f32, as a parameter would be

    def fn(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x + pos.to(x.dtype) * 2.0, (48,))

    _one_kernel(fn, target, x, pos, dtype=dtype)


@pytest.mark.parametrize("target", TARGETS)
def test_a_broadcast_value_read_outside_too(target) -> None:
    """A broadcast member is never a side output (the kernel stores row-shaped and
    per-row values only): the value another op reads too comes out right."""
    torch.manual_seed(0)
    x, b = torch.randn(5, 40, device=DEVICE), torch.randn(40, device=DEVICE)

    def fn(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = torch.exp(b)
        return F.softmax(x * e, dim=-1), e.sum() * e

    _check(fn, target, x, b)
    assert not set(outside_ops()) - VIEWS, outside_ops()


@pytest.mark.parametrize("target", TARGETS)
def test_a_per_row_value_saved_for_the_backward_stays_a_side_output(target) -> None:
    """An RMSNorm in training saves its per-row rsqrt for the backward. The group
    grows from the output, before any reduction fixes the row dim, and meets the
    rsqrt first: it is still a per-row side output of the one row kernel."""
    torch.manual_seed(0)
    w, x = torch.rand(32, device=DEVICE), torch.randn(3, 5, 32, device=DEVICE)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x + 1.0
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    _check(rms, target, x, w, grad=True)  # results and both gradients against eager
    forward = report.RECORDS[0]
    # one row kernel (row_multi: Triton's narrow rows, several a program)
    assert [k["kind"] for k in forward.kernels] in (["row"], ["row_multi"]), \
        [k["ops"] for k in forward.kernels]
