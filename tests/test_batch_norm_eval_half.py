"""Batch norm in eval mode over a half input (a CNN's bf16 or f16 inference):
rules/decompose/norms.yaml's batch-norm-eval-half computes it in f32 and rounds
once, as ATen does, so it joins the pointwise kernel after the convolution instead
of running as ATen's op (ResNet-50's bf16 inference on an H200 ran 53 of them, 160
ATen kernels a step). Differential against eager, half parameters and f32 ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops, rules_fired, tol
from rewritec import report

DEVICE, TARGETS = kernel_targets()


def _block(channels: int, dtype: torch.dtype, f32_norm: bool) -> nn.Module:
    m = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                      nn.ReLU(), nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels))
    with torch.no_grad():
        for bn in (m[1], m[4]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.3, 3.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    m = m.eval().to(DEVICE, dtype)
    if f32_norm:  # half activations into f32 statistics and affine parameters
        m[1].float()
        m[4].float()
    return m


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("f32_norm", [False, True], ids=["half-params", "f32-params"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,channels_last", [((2, 3, 9, 7), False), ((1, 3, 16, 16), True),
                                                 ((3, 3, 5, 6), False)], ids=str)
def test_half_batch_norm_in_eval_matches_eager(target, f32_norm, dtype, shape, channels_last
                                               ) -> None:
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("OpenMP kernels compute no f16")
    torch.manual_seed(0)
    m = _block(6, dtype, f32_norm)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    report.reset()
    compiled = torch.compile(m, backend="rewritec", options={"target": target}, dynamic=False)
    with torch.no_grad():
        got, want = compiled(x), m(x)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert rules_fired()["batch-norm-eval-half"] == 2
    assert "_native_batch_norm_legit_no_training" not in outside_ops()
    # each batch norm (and the relu after the first) runs inside a kernel
    assert not {"relu", "mul", "add", "_to_copy"} & set(outside_ops())


def test_a_half_input_with_f16_statistics_under_bf16_stays_atens() -> None:
    """A mix ATen may refuse (f16 statistics, a bf16 input) is left to ATen, with
    whatever eager says about it."""
    torch.manual_seed(0)
    m = _block(4, torch.bfloat16, False)
    m[1].half()
    x = torch.randn(2, 3, 6, 6, device=DEVICE, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            want: torch.Tensor | Exception = m(x)
    except RuntimeError as e:
        want = e
    report.reset()
    compiled = torch.compile(m, backend="rewritec", dynamic=False)
    if isinstance(want, Exception):
        with pytest.raises(RuntimeError), torch.no_grad():
            compiled(x)
        return
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want, **tol(torch.bfloat16))
    assert rules_fired()["batch-norm-eval-half"] == 1  # the second batch norm only
