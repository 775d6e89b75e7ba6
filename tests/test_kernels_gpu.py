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


# ------------------------------------------------------------------ matmul template
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (7, 5, 33), (1000, 768, 3072),
                                   (4096, 1024, 1024)])
def test_matmul_epilogue_on_gpu(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    import torch.nn.functional as F
    from test_kernels_matmul import check

    x, w, b = (torch.randn(m, k).to(dtype).cuda(), torch.randn(n, k).to(dtype).cuda() * 0.05,
               torch.randn(n).to(dtype).cuda())
    check(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), x, w, b, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_3d_residual_on_gpu(dtype: torch.dtype) -> None:
    import torch.nn.functional as F
    from test_kernels_matmul import check

    x, r = torch.randn(4, 257, 768).to(dtype).cuda(), torch.randn(4, 257, 768).to(dtype).cuda()
    w, b = torch.randn(768, 768).to(dtype).cuda() * 0.03, torch.randn(768).to(dtype).cuda()
    check(lambda x, w, b, r: r + F.linear(x, w, b), x, w, b, r, dtype=dtype)


def test_copy_kernel_on_gpu() -> None:
    x = torch.randn(8, 1024, 12, 64, device="cuda", dtype=torch.float16)
    _check(lambda x: x.transpose(1, 2).contiguous(), "triton", x)
