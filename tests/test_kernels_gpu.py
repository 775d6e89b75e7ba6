"""The Triton templates on a real GPU (skipped without CUDA): the same cases as
tests/test_kernels.py on CUDA tensors, plus half precision and larger rows."""

from __future__ import annotations

import pytest
import torch

from test_kernels import FUNCS, _check, _layout, layer_norm, pointwise, rms_norm, softmax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.cuda() for x in xs]


@pytest.mark.parametrize("fn", FUNCS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "broadcast"])
def test_templates_on_gpu(fn, layout: str) -> None:
    _check(fn, "triton", *_cuda(_layout(layout, (13, 17), torch.float32), torch.randn(17)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", FUNCS, ids=lambda f: f.__name__)
def test_half_precision_on_gpu(fn, dtype: torch.dtype) -> None:
    _check(fn, "triton", *_cuda(torch.randn(64, 1000).to(dtype), torch.randn(1000).to(dtype)),
           tol=3e-2)


@pytest.mark.parametrize("cols", [1, 7, 1023, 4097, 32768])
@pytest.mark.parametrize("fn", [pointwise, softmax, layer_norm, rms_norm],
                         ids=lambda f: f.__name__)
def test_row_widths_on_gpu(fn, cols: int) -> None:
    _check(fn, "triton", *_cuda(torch.randn(8, cols), torch.randn(cols)),
           expect_kernels=cols > 1 or fn is pointwise)


@pytest.mark.parametrize("fn", [pointwise, softmax, layer_norm, rms_norm],
                         ids=lambda f: f.__name__)
def test_backward_on_gpu(fn) -> None:
    _check(fn, "triton", *_cuda(torch.randn(16, 300), torch.randn(300)), grad=True)
