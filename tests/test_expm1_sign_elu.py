"""expm1 and sign inside kernels (rules/ops.yaml), and ELU / SELU / CELU written out
with expm1 (rules/decompose/activations.yaml): each ran through ATen, outside the
kernels, in L1 and smooth-L1 losses, every abs's gradient, softsign, and ELU-family
activations. Differential against eager on both targets, with the values where the
plain form loses every digit (|x| near 0) and nan, infinities, signed zeros."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import check_block_under_autocast, check_grad, rules_fired, target_device, \
    target_params, with_values

import rewritec
from rewritec import report

TARGETS = target_params()
SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-10, -1e-10, 1e-6, -1e-6,
           -1.0, -2.0, 1e-30, 3.0, -3.0, 100.0, -100.0, 0.5, -0.5]
FUNCS = {
    "expm1": (lambda x: torch.expm1(x) + 0.0, "expm1"),
    "sign": (lambda x: torch.sign(x) * 3.0, "sign"),
    "elu": (lambda x: F.elu(x) * 1.0, "elu"),
    "selu": (lambda x: F.selu(x) * 1.0, "elu"),
    "celu": (lambda x: F.celu(x, alpha=0.7) * 1.0, "expm1"),
}


def _outside(op: str) -> list[dict]:
    return [dict(r.fallback_ops) for r in report.RECORDS if op in r.fallback_ops]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_in_kernels_equal_eager_on_special_values(target: str, name: str,
                                                  dtype: torch.dtype) -> None:
    if target == "openmp" and dtype in (torch.bfloat16, torch.float16):
        pytest.skip("the OpenMP target computes f32 and f64 only")
    fn, op = FUNCS[name]
    x = with_values((6, 37), dtype, SPECIAL).to(target_device(target))
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    want = fn(x)
    half = dtype in (torch.bfloat16, torch.float16)
    # near 0 the corrected forms are exact to a few ulps, where log(1 + x) gives 0
    tol = {"rtol": 2e-2, "atol": 2e-2} if half else {"rtol": 1e-5, "atol": 1e-30}
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    zeros = want == 0
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(want[zeros]))
    assert [k for r in report.RECORDS for k in r.kernels]
    assert not _outside(op), _outside(op)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(5, 17), (3, 4, 9)])
@pytest.mark.parametrize("name", ["l1", "smooth_l1", "softsign", "elu", "selu", "celu",
                                  "abs_pow"])
def test_gradients_equal_eager(target: str, shape: tuple, name: str) -> None:
    losses = {
        "l1": lambda y, t: F.l1_loss(y, t),
        "smooth_l1": lambda y, t: F.smooth_l1_loss(y, t),
        "softsign": lambda y, t: (F.softsign(y) * t).mean(),
        "elu": lambda y, t: (F.elu(y) * t).mean(),
        "selu": lambda y, t: (F.selu(y) * t).mean(),
        "celu": lambda y, t: (F.celu(y, alpha=0.7) * t).mean(),
        "abs_pow": lambda y, t: (y.abs() * t).sum(),
    }
    torch.manual_seed(0)
    dev = target_device(target)
    x, t = (torch.randn(*shape) * 3.0).to(dev), torch.randn(*shape).to(dev)
    x = x.transpose(0, -1) if len(shape) == 2 else x
    t = t.transpose(0, -1) if len(shape) == 2 else t
    report.reset()
    check_grad(losses[name], x, target, t)
    for op in ("expm1", "sign", "elu"):
        assert not _outside(op), _outside(op)


def test_an_elu_block_trains_in_kernels_under_autocast() -> None:
    """Linear + ELU + Linear under bf16 autocast: losses and gradients equal eager's,
    with the ELU (forward and backward) inside kernels."""
    check_block_under_autocast(
        lambda: torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ELU(),
                                    torch.nn.Linear(48, 24)),
        torch.randn(4, 10, 24))
    assert rules_fired()["elu-half"] == 1
    assert not _outside("elu") and not _outside("expm1")
