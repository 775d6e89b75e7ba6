"""The backward of GELU's tanh form inside kernels (rules/decompose/activations.yaml:
gelu-backward-tanh, -half): it ran through ATen, outside every kernel, in any training
step of a model using `F.gelu(x, approximate="tanh")`. Differential against eager, on
both targets, several shapes, layouts and dtypes, special values included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import check_block_under_autocast, check_grad, rules_fired, target_device, \
    target_params

from rewritec import report

TARGETS = target_params()


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
    x = (torch.randn(*shape) * 3.0).to(dtype).to(target_device(target))
    x = x.transpose(0, -1) if transposed else x
    report.reset()
    # eager rounds the backward's result once, from f32, as the -half rule does
    half = dtype in (torch.bfloat16, torch.float16)
    tol = {"rtol": 2e-2, "atol": 2e-2} if half else {}
    check_grad(lambda t: F.gelu(t * 1.5, approximate="tanh"), x, target, **tol)
    assert rules_fired()["gelu-backward-tanh-half" if half else "gelu-backward-tanh"] == 1
    assert not _outside(), [dict(r.fallback_ops) for r in report.RECORDS]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gelu_tanh_gradient_of_special_values(target: str, dtype: torch.dtype) -> None:
    """nan, infinities and zeros give ATen's gradients."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-8, -30.0,
                      30.0, 3.0, -3.0], dtype=dtype, device=target_device(target))
    check_grad(lambda t: F.gelu(t, approximate="tanh") * 2.0, x, target, equal_nan=True)


def test_a_tanh_gelu_mlp_trains_in_kernels_under_autocast() -> None:
    """A Linear + tanh-GELU + Linear block under bf16 autocast: loss and gradients
    equal eager's, and no GELU op runs outside a kernel, forward or backward."""
    check_block_under_autocast(
        lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"),
                                    torch.nn.Linear(64, 32)),
        torch.randn(8, 16, 32))
    assert rules_fired()["gelu-backward-tanh-half"] == 1
    assert not _outside(), [dict(r.fallback_ops) for r in report.RECORDS]
