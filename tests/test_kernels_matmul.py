"""The Triton matmul template with its epilogue (rule fuse-matmul), against eager.

On a machine without a GPU these run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1); tests/test_kernels_gpu.py runs the same template on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need TRITON_INTERPRET=1; see test_kernels_gpu.py")

# Half-precision products differ from eager's by rounding: eager rounds the product
# to f16 before the epilogue, the kernel keeps f32 until the store. The interpreter
# also truncates (not rounds) bf16 stores, hence a looser bf16 tolerance here.
TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


def matmul_kernels() -> list[dict]:
    return [k for r in report.RECORDS for k in r.kernels if k["rules"] == ["fuse-matmul"]]


def check(fn, *inputs: torch.Tensor, dtype: torch.dtype, fused: bool = True,
          target: str = "triton") -> None:
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(*inputs)
    want = fn(*inputs)
    torch.testing.assert_close(got, want, rtol=TOL.get(dtype, 1e-4), atol=TOL.get(dtype, 1e-4))
    assert len(matmul_kernels()) == (1 if fused else 0), [
        k["rules"] for r in report.RECORDS for k in r.kernels]


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (7, 5, 33), (64, 48, 32), (130, 64, 97)])
def test_linear_relu(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    """addmm + bias + relu: odd sizes leave partial tiles in every dim."""
    x, w, b = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, seed=1), rand(n, dtype=dtype)
    check(lambda x, w, b: torch.relu(F.linear(x, w, b)), x, w, b, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_3d_gelu_residual(dtype: torch.dtype) -> None:
    """A Linear on [B, T, C] (a reshape around addmm), tanh-GELU, then a residual add:
    the epilogue sees through the reshape."""
    x, r = rand(2, 9, 24, dtype=dtype), rand(2, 9, 40, dtype=dtype, seed=2)
    w, b = rand(40, 24, dtype=dtype, seed=1), rand(40, dtype=dtype, seed=3)

    def f(x, w, b, r):
        return r + F.gelu(F.linear(x, w, b), approximate="tanh")

    check(f, x, w, b, r, dtype=dtype)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "broadcast-scale"])
def test_strided_operands_and_epilogue_inputs(layout: str) -> None:
    dtype = torch.float16
    x = rand(40, 24, dtype=dtype)
    w = rand(24, 36, dtype=dtype, seed=1)
    scale = rand(36, dtype=dtype, seed=2)
    if layout == "transposed":
        x = rand(24, 40, dtype=dtype).t()
    elif layout == "sliced":
        w = rand(24, 72, dtype=dtype, seed=1)[:, ::2]
    else:
        scale = rand(1, dtype=dtype, seed=2).expand(36)

    def f(x, w, s):
        return torch.sigmoid(x @ w) * s

    check(f, x, w, scale, dtype=dtype)


def test_alpha_beta_addmm() -> None:
    dtype = torch.float16
    b, x, w = rand(16, 32, dtype=dtype), rand(16, 8, dtype=dtype), rand(8, 32, dtype=dtype)
    check(lambda b, x, w: torch.tanh(torch.addmm(b, x, w, beta=0.5, alpha=2.0)), b, x, w,
          dtype=dtype)


def test_f32_products_stay_with_blas() -> None:
    """The rule's guard keeps f32 on cuBLAS/BLAS: eager's f32 products are IEEE."""
    x, w = rand(16, 8, dtype=torch.float32), rand(8, 32, dtype=torch.float32)
    check(lambda x, w: torch.relu(x @ w) * 2.0, x, w, dtype=torch.float32, fused=False)


def test_openmp_target_fuses_only_the_epilogue() -> None:
    """The CPU target has no matmul template: the product stays on ATen and the
    epilogue becomes a pointwise kernel."""
    x, w = rand(16, 8, dtype=torch.float32), rand(8, 32, dtype=torch.float32)
    check(lambda x, w: torch.relu(x @ w) * 2.0 + 1.0, x, w, dtype=torch.float32, fused=False,
          target="openmp")
    rules = [k["rules"] for r in report.RECORDS for k in r.kernels]
    assert rules == [["fuse-pointwise"]]


def test_mlp_backward_f16() -> None:
    """Training a Linear-GELU-Linear in f16: the backward graph's grad @ W2 carries
    GELU's backward as its epilogue. (The forward's product is saved for backward,
    so its GELU cannot hide inside a one-output kernel.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 16)).half()
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                              torch.nn.Linear(32, 16)).half()
    ref.load_state_dict(model.state_dict())
    x = rand(24, 16, dtype=torch.float16)
    report.reset()
    torch._dynamo.reset()
    compiled = rewritec.compile(model, target="triton", strict=True)
    compiled(x).float().pow(2).sum().backward()
    ref(x).float().pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)
    backward = [k for r in report.RECORDS if "backward" in r.name for k in r.kernels
                if k["rules"] == ["fuse-matmul"]]
    assert len(backward) == 1
