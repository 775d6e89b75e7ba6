"""Long reductions are as accurate as ATen's: a differential test against a float64
reference, where rewritec's error may be at most a small factor over ATen's own.

ATen sums pairwise; a kernel whose every vector lane (OpenMP) or block lane (Triton)
adds a long run of values one after another drifts with the length
(kinds/accumulators.py, kinds/reduction.py: triton_accumulate). The OpenMP
cases are long enough to show it (ten million 0.1s were 0.3% off); the Triton ones,
under the interpreter, are smaller and aim at its loops: a looped row, a reduction
split over programs. Half inputs accumulate in f32, so their sums are checked as
f32 results (`x.float().sum()`) and, rounded, in their own dtype. Every case checks
which template made the kernel, so an ATen fallback cannot pass for a kernel.
"""

from __future__ import annotations

import pytest
import rewritec
import torch
import torch.nn.functional as F
from rewritec import report
from test_kernels import TARGETS

# rewritec's error may exceed ATen's by this factor (blocks of different sizes
# round differently; a drifting lane is off by 10-1000x here)
FACTOR = 4.0


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _check(fn, target: str, x: torch.Tensor, template: str) -> None:
    """rewritec's error against fn in float64 is at most FACTOR times ATen's (or, where
    ATen is exact, FACTOR half-ulps of the output's dtype), and `template` made the kernel."""
    report.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        got = rewritec.compile(fn, target=target, strict=True)(x)
        want = fn(x)
        ref = fn(x.double())
    kernels = {k["template"] for r in report.RECORDS for k in r.kernels}
    assert f"{target}/{template}" in kernels, kernels
    ulp = torch.finfo(got.dtype).eps / 2
    err, aten = _rel_error(got, ref), _rel_error(want, ref)
    assert err <= FACTOR * max(aten, ulp), f"rewritec {err:.3g}, ATen {aten:.3g}"


def full_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def full_sum_f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().sum()


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(-1)


def col_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def row_var(x: torch.Tensor) -> torch.Tensor:
    """The variance as layer_norm's decomposition writes it (a row kernel)."""
    return ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    # with a weight: a half layer_norm without one stays ATen's on the CPU
    return F.layer_norm(x, x.shape[-1:], torch.ones(x.shape[-1], dtype=x.dtype, device=x.device))


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


def _tenths(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, 0.1, dtype=dtype)


def _uniform(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values in [1, 2): a mean far from zero, as activations often have."""
    return (torch.rand(shape) + 1).to(dtype)


OPENMP = [t for t in TARGETS if t.values[0] == "openmp"]
TRITON = [t for t in TARGETS if t.values[0] == "triton"]


# ------------------------------------------------------------------ OpenMP, long
@pytest.mark.parametrize("target", OPENMP)
@pytest.mark.parametrize("fn, make, template", [
    (full_sum, lambda: _tenths(2**24 + 4099), "reduction"),
    (full_sum, lambda: torch.ones(2**24 + 4099), "reduction"),
    (row_sum, lambda: _tenths(4, 2**22), "reduction"),
    (row_mean, lambda: _uniform(4, 2**22), "reduction"),
    (col_sum, lambda: _tenths(2**16, 64), "reduction"),
    (row_var, lambda: _uniform(4, 2**22), "row"),
    (layer_norm, lambda: _uniform(4, 2**22), "row"),
    (rms_norm, lambda: _uniform(4, 2**22), "row"),
], ids=["sum-tenths", "sum-ones", "row-sum", "row-mean", "col-sum", "row-var", "layer-norm",
        "rms-norm"])
def test_openmp_long_reductions(target: str, fn, make, template: str) -> None:
    _check(fn, target, make(), template)


# ------------------------------------------------------------------ Triton, interpreted
@pytest.mark.parametrize("target", TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fn, shape, template", [
    (full_sum_f32, (2**20 + 3,), "reduction"),
    (row_mean, (4, 2**18), "reduction"),
    (row_var, (2, 2**20), "row_looped"),
    (layer_norm, (2, 2**20), "row_looped"),
    (rms_norm, (2, 2**20), "row_looped"),
], ids=["sum", "row-mean", "row-var", "layer-norm", "rms-norm"])
def test_triton_long_reductions(target: str, dtype: torch.dtype, fn, shape, template) -> None:
    """Triton reductions split over programs, and rows of 32 chunks (looped rows).
    The interpreter runs them on CPU tensors (16 s a layer_norm case)."""
    if fn is layer_norm and dtype == torch.float16:
        pytest.skip("the bf16 case takes the same half-precision path")
    if fn is layer_norm and dtype == torch.float32:
        pytest.skip("the interpreter runs tl.reduce's Welford combine over the 1024 lanes "
                    "one after another; a GPU combines them as a tree "
                    "(test_looped_layer_norm_on_the_gpu)")
    _check(fn, target, _uniform(*shape, dtype=dtype) - 0.9, template)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("width", [4096, 2**20])
def test_looped_layer_norm_on_the_gpu(width: int) -> None:
    """The looped row's Welford lanes, merged by tl.reduce as a tree on the GPU."""
    x = _uniform(8, width).cuda() - 0.9
    report.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        got = rewritec.compile(layer_norm, strict=True)(x)
        want, ref = layer_norm(x), layer_norm(x.double())
    assert "triton/row_looped" in {k["template"] for r in report.RECORDS for k in r.kernels}
    err, aten = _rel_error(got, ref), _rel_error(want, ref)
    assert err <= FACTOR * max(aten, torch.finfo(got.dtype).eps / 2), (err, aten)
