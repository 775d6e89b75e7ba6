"""A convolution's bias as an add after it (rules/decompose/convolution.yaml,
conv-bias-as-add), so that the add joins the kernel of what follows instead of
ATen's bias launch after cuDNN's: results and gradients against eager over
convolution kinds (2-d, grouped 1-d, transposed), dtypes and both kernel targets;
a squeeze-excite block's bias adds and activations each run inside one kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops, rules_fired, tol
from rewritec import report

DEVICE, TARGETS = kernel_targets()


class SqueezeExcite(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.conv(x))
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return y * s


class Grouped1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x)) * 2.0


CASES = {"squeeze-excite": (SqueezeExcite, (2, 3, 9, 7), 3),
         "grouped-1d": (Grouped1d, (3, 4, 17), 1),
         "transposed": (Transposed, (2, 4, 5, 6), 1)}


def _half_ok(target: str, dtype: torch.dtype) -> None:
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("OpenMP kernels compute no f16")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_inference_with_the_bias_added_after(target, dtype, case) -> None:
    _half_ok(target, dtype)
    torch.manual_seed(0)
    cls, shape, convs = CASES[case]
    m = cls().eval().to(DEVICE, dtype)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    report.reset()
    compiled = torch.compile(m, backend="rewritec", options={"target": target}, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), **tol(dtype))
    assert rules_fired()["conv-bias-as-add"] == convs
    # the bias adds and the activations after them are computed in kernels
    assert not {"add", "relu", "tanh", "sigmoid", "hardsigmoid", "mul"} & set(outside_ops())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_training_with_the_bias_added_after(target, case) -> None:
    torch.manual_seed(0)
    cls, shape, _ = CASES[case]
    m = cls().to(DEVICE)
    ref = cls().to(DEVICE)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(shape, device=DEVICE)
    compiled = torch.compile(m, backend="rewritec", options={"target": target}, dynamic=False)
    got, want = compiled(x), ref(x)
    torch.testing.assert_close(got, want, **tol(torch.float32))
    cot = torch.randn_like(want)
    got.backward(cot)
    want.backward(cot)
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol(torch.float32), msg=name)


class ConvThenNorm(nn.Module):
    """ConvNeXt's order: a depthwise convolution read through a permute by a layer
    norm. No pointwise op takes the add there, so the bias stays the convolution's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x).permute(0, 2, 3, 1))


@pytest.mark.parametrize("target", TARGETS)
def test_a_bias_nothing_pointwise_reads_stays_in_the_convolution(target) -> None:
    torch.manual_seed(0)
    m = ConvThenNorm().eval().to(DEVICE)
    x = torch.randn(2, 8, 5, 6, device=DEVICE)
    report.reset()
    compiled = torch.compile(m, backend="rewritec", options={"target": target}, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), **tol(torch.float32))
    assert rules_fired()["conv-bias-as-add"] == 0
