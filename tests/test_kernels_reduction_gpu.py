"""The `reduction` and `row_looped` Triton templates on a real GPU (skipped
without CUDA): the cases of tests/test_kernels_reduction.py on CUDA tensors,
plus sizes the interpreter cannot afford: a 16M-element full reduction (split
over many programs), a bias gradient over 8192 rows, and 32K-wide rows for
layer_norm, softmax and rms_norm (the looped row kernel at its real threshold)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewritec import report
from rewritec.runtime.reduction_launch import ReductionTritonLauncher
from test_kernels import _layout, layer_norm, log_softmax, rms_norm, softmax
from test_kernels_reduction import (REDUCE_2D, REDUCE_3D, _run, _run_nan, _special,
                                    both_phases, norm_02, sum_over_max)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.cuda() for x in xs]


@pytest.fixture
def splits(monkeypatch) -> list[int]:
    seen: list[int] = []
    split = ReductionTritonLauncher.split

    def record(self, *args) -> tuple[int, int]:
        got = split(self, *args)
        seen.append(got[0])
        return got

    monkeypatch.setattr(ReductionTritonLauncher, "split", record)
    return seen


@pytest.mark.parametrize("fn", REDUCE_2D, ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "broadcast"])
def test_reduction_on_gpu(fn, layout: str) -> None:
    _run(fn, "triton", *_cuda(_layout(layout, (130, 1017), torch.float32)), tol=1e-4)


@pytest.mark.parametrize("fn", REDUCE_3D, ids=lambda f: f.__name__)
def test_reduction_3d_on_gpu(fn) -> None:
    _run(fn, "triton", *_cuda(torch.randn(64, 96, 129).permute(1, 0, 2)), tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", REDUCE_2D, ids=lambda f: f.__name__)
def test_reduction_half_precision_on_gpu(fn, dtype: torch.dtype) -> None:
    _run(fn, "triton", *_cuda(torch.randn(64, 1000).to(dtype)), tol=3e-2)


@pytest.mark.parametrize("fn", [norm_02, sum_over_max, both_phases], ids=lambda f: f.__name__)
def test_prologue_and_epilogue_on_gpu(fn) -> None:
    _run(fn, "triton", *_cuda(torch.randn(32, 64, 300), torch.randn(300)), tol=1e-4)


@pytest.mark.parametrize("op", ["amax", "amin", "sum"])
@pytest.mark.parametrize("dim", [(1,), (0, 1), None])
def test_nan_and_inf_on_gpu(op: str, dim) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        reduce = getattr(torch, op)
        return (reduce(x) if dim is None else reduce(x, dim=dim)) * 2.0

    _run_nan(fn, "triton", *_cuda(_special((5, 9))))


@pytest.mark.parametrize("name", ["sum", "mean", "amax", "amax_nan"])
def test_full_reduction_16m_splits(splits: list[int], name: str) -> None:
    x = torch.randn(1 << 24, device="cuda")
    if name == "amax_nan":
        x[12345678] = float("nan")
        _run_nan(lambda x: x.amax() * 2.0, "triton", x)
    else:
        _run(lambda x: getattr(x, name)() + 1.0, "triton", x, tol=1e-3)
    assert max(splits) > 1


def test_bias_gradient_splits(splits: list[int]) -> None:
    """sum over (0, 1) of a [8, 1024, 768] gradient: 768 outputs of 8192 each."""
    _run(lambda g: g.sum(dim=(0, 1)), "triton", torch.randn(8, 1024, 768, device="cuda"),
         tol=1e-3)
    assert max(splits) > 1


def test_linear_bias_gradient_3d_on_gpu() -> None:
    from test_kernels import _check

    w = torch.randn(768, 512, device="cuda")

    def fn(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, w, b))

    _check(fn, "triton", *_cuda(torch.randn(8, 256, 512), torch.randn(768)), grad=True,
           tol=1e-3)


@pytest.mark.parametrize("cols", [32769, 50000])
@pytest.mark.parametrize("fn", [softmax, log_softmax, layer_norm, rms_norm],
                         ids=lambda f: f.__name__)
def test_wide_rows_loop_on_gpu(fn, cols: int) -> None:
    _run(fn, "triton", *_cuda(torch.randn(64, cols), torch.randn(cols)),
         template="row_looped", tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", [softmax, layer_norm], ids=lambda f: f.__name__)
def test_wide_rows_half_precision_on_gpu(fn, dtype: torch.dtype) -> None:
    _run(fn, "triton", *_cuda(torch.randn(16, 40000).to(dtype), torch.randn(40000).to(dtype)),
         template="row_looped", tol=3e-2)


def test_wide_rows_backward_on_gpu() -> None:
    from test_kernels import _check

    _check(layer_norm, "triton", *_cuda(torch.randn(8, 40000), torch.randn(40000)),
           grad=True, tol=1e-3)
    assert "triton/row_looped" in {k["template"] for r in report.RECORDS for k in r.kernels}
