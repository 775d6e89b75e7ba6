"""bf16 in the OpenMP kernels (kinds/kernels.py: CPP_BF16): bf16 tensors read as
float and are written rounding to nearest even, each op's result rounded as ATen's
CPU kernels round it, so CPU autocast's casts and bf16 models compute in kernels,
not on ATen, with eager's values. f16 stays with ATen on the CPU (its conversions
did not vectorize), and still equals eager."""

from __future__ import annotations

import collections

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.runtime.build import cxx

pytestmark = pytest.mark.skipif(cxx() is None, reason="no C++ compiler")
HALVES = [torch.bfloat16, torch.float16]
IN_KERNELS = {torch.bfloat16: True, torch.float16: False}


def _compiled(fn, *args: torch.Tensor) -> tuple[torch.Tensor, collections.Counter[str], int]:
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target="openmp", strict=True)(*args)
    outside: collections.Counter[str] = collections.Counter()
    for r in report.RECORDS:
        outside.update(r.fallback_ops)
    return got, outside, sum(len(r.kernels) for r in report.RECORDS)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int16 if want.element_size() == 2 else torch.int32
    g, w = got.view(bits)[~nan], want.view(bits)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} differ, first at {want[~nan][bad[0]]}"


def _edge_floats() -> torch.Tensor:
    """Random bit patterns (every exponent: subnormals, nan, inf) and the values where
    rounding to 16 bits turns: each half's neighbours and the midpoints between them."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 18,), generator=g, dtype=torch.int64)
    random = bits.to(torch.int32).view(torch.float32)
    edges = []
    for dtype in HALVES:
        every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
        f = every.float()
        f = f[torch.isfinite(f)].sort().values
        mids = (f[1:].double() + f[:-1].double()) / 2
        edges += [f, mids.float(), torch.nextafter(mids, torch.tensor(0.0, dtype=torch.float64))
                  .float(), torch.nextafter(mids.float(), torch.tensor(float("inf")))]
    big = torch.tensor([65504.0, 65519.99, 65520.0, 3.39e38, -65520.0, 1e-8, 6e-8, 3e-8,
                        -0.0, 0.0, float("inf"), -float("inf"), float("nan")])
    return torch.cat([random, *edges, big]).contiguous()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_a_cast_to_a_half_rounds_as_aten_does(dtype: torch.dtype) -> None:
    x = _edge_floats()
    got, outside, kernels = _compiled(lambda a: a.to(dtype), x)
    _same_bits(got, x.to(dtype))
    assert (kernels, not outside) == ((1, True) if IN_KERNELS[dtype] else (0, False))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_every_half_reads_as_aten_reads_it(dtype: torch.dtype) -> None:
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    got, _, kernels = _compiled(lambda a: a.float() * 1.0, every)
    _same_bits(got, every.float())
    # and back again: a value read and written keeps its bits (but -0 + 0 is +0)
    back, _, _ = _compiled(lambda a: (a.float() + 0.0).to(dtype), every)
    _same_bits(back, (every.float() + 0.0).to(dtype))
    assert kernels == IN_KERNELS[dtype]


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("shape", [(33, 70), (4, 5, 130)], ids=str)
def test_half_tensors_in_kernels(dtype: torch.dtype, shape) -> None:
    """Pointwise, row (softmax, layer_norm: f32 inside, one rounding) and reduction
    kernels over half inputs and outputs, strided too."""
    torch.manual_seed(shape[-1])
    x = torch.randn(shape).to(dtype)
    y = torch.randn(shape[-1]).to(dtype)
    cases = {
        "pointwise": lambda a, b: torch.sigmoid(a) * b - 1.0,
        "softmax": lambda a, b: torch.softmax(a, -1),
        "layer_norm": lambda a, b: torch.nn.functional.layer_norm(a, a.shape[-1:], b, b),
        "sum": lambda a, b: a.float().sum(-1),
        "strided": lambda a, b: (a.transpose(-1, -2) * 2.0).contiguous(),
    }
    for name, fn in cases.items():
        got, outside, kernels = _compiled(fn, x, y)
        # each half op rounds as eager's does: the dtype's own tolerance (the f32
        # insides of softmax and layer_norm sum in another order)
        tol = {} if name in ("pointwise", "strided") else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(got, fn(x, y), msg=name, **tol)
        if IN_KERNELS[dtype]:
            assert kernels >= 1 and not ({"_to_copy", "sigmoid", "_softmax",
                                          "native_layer_norm"} & set(outside)), (name, outside)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))
        return torch.softmax(h + x, dim=-1)


def test_cpu_autocast_training_computes_its_casts_in_kernels() -> None:
    """Under CPU bf16 autocast the casts around each product and the half
    activations run in kernels; the losses and gradients equal eager's."""
    torch.manual_seed(0)
    model = Block(32)
    x = torch.randn(6, 7, 32)
    compiled = torch.compile(model, backend="rewritec", options={"target": "openmp",
                                                                 "strict": True})
    report.reset()
    torch._dynamo.reset()
    grads = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        (out.float() * torch.linspace(-1, 1, 32)).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, ref), (got, mine) = grads
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for g, w in zip(mine, ref, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * max(1.0, float(w.abs().max())))
    outside: collections.Counter[str] = collections.Counter()
    for r in report.RECORDS:
        outside.update(r.fallback_ops)
    assert not {"_to_copy", "gelu", "gelu_backward", "native_layer_norm",
                "native_layer_norm_backward"} & set(outside), outside
