"""isnan and isinf inside kernels (rules/decompose/predicates.yaml): comparisons
kernels compute, exact on nan, infinities, signed zeros and integers, forward and
backward, on both targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import check_grad, outside_ops, rules_fired, target_device, target_params, \
    with_values
from rewritec import report

import rewritec


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e30, -1e-30, 2.0]


@pytest.mark.parametrize("target", target_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_nan_and_inf_masks_equal_eager(target, dtype) -> None:
    device = target_device(target)
    if target == "openmp" and dtype == torch.bfloat16:
        dtype = torch.float32  # (bf16 kernels on the CPU: tests/test_cpu_halves.py)
    x = with_values((5, 19), dtype, SPECIAL).to(device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        clean = torch.where(torch.isnan(x), 0.0, x)
        return torch.where(torch.isinf(clean), 1.0, clean * 2.0) + torch.isnan(x).to(x.dtype)

    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    torch.testing.assert_close(got, fn(x), equal_nan=True)
    assert not {"isnan", "isinf"} & set(outside_ops()), outside_ops()
    fired = rules_fired()
    assert fired["isnan-as-ne"] >= 1 and fired["isinf-as-eq"] >= 1


def test_integers_are_never_nan() -> None:
    x = torch.arange(-5, 5, dtype=torch.int64)
    fn = lambda x: torch.where(torch.isnan(x), 0, x) + 1  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(rewritec.compile(fn, strict=True)(x), fn(x))


@pytest.mark.parametrize("target", target_params())
@pytest.mark.parametrize("shape", [(4, 10), (2, 3, 7)], ids=str)
def test_kl_div_in_kernels_forward_and_backward(target, shape) -> None:
    """kl_div's decomposition masks the target's nan with isnan."""
    torch.manual_seed(0)
    device = target_device(target)
    x = torch.log_softmax(torch.randn(*shape), -1).to(device)
    y = torch.softmax(torch.randn(*shape), -1).to(device)
    y.view(-1)[0] = 0.0  # 0 * log 0: the masked term
    report.reset()
    check_grad(lambda x, y: F.kl_div(x, y, reduction="batchmean"), x, target, y)
    assert "isnan" not in outside_ops() and rules_fired()["isnan-as-ne"] >= 1
