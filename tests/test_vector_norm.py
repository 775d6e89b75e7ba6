"""p-norms over dims inside kernels (rules/decompose/reductions.yaml: vector-norm-2, -1,
-half): `linalg_vector_norm` (F.normalize, gradient clipping, cosine similarity's
norms) ran through ATen. Differential against eager on both targets: p = 1, 2 and 3
(which stays ATen's), dims, keepdim, dtypes, transposed inputs, zeros, nan and
infinities, and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import check_grad, rules_fired, target_device, target_params

import rewritec
from rewritec import report

TARGETS = target_params()
CASES = {
    "normalize_rows": (lambda x: F.normalize(x, dim=-1) * 2.0, "vector-norm-2"),
    "normalize_cols": (lambda x: F.normalize(x, dim=0) + 1.0, "vector-norm-2"),
    "l2_all": (lambda x: torch.linalg.vector_norm(x) * 1.0, "vector-norm-2"),
    "l1_keepdim": (lambda x: x / torch.linalg.vector_norm(x, ord=1, dim=1, keepdim=True),
                   "vector-norm-1"),
    "l3_stays": (lambda x: torch.linalg.vector_norm(x, ord=3, dim=1) * 1.0, None),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
def test_norms_in_kernels_equal_eager(target: str, case: str, dtype: torch.dtype,
                                      transposed: bool) -> None:
    if target == "openmp" and dtype == torch.bfloat16:
        pytest.skip("the OpenMP target computes f32 and f64 only")
    torch.manual_seed(0)
    x = (torch.randn(6, 37) * 3.0).to(dtype).to(target_device(target))
    x[2] = 0.0  # a zero row: F.normalize divides by its clamped norm
    x = x.t() if transposed else x
    fn, rule = CASES[case]
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    want = fn(x)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    if rule is None:
        assert any("linalg_vector_norm" in r.fallback_ops for r in report.RECORDS)
        return
    half = dtype == torch.bfloat16
    assert rules_fired()[rule] == 1 and rules_fired()["vector-norm-half"] == int(half)
    assert not [r.fallback_ops for r in report.RECORDS if "linalg_vector_norm" in r.fallback_ops]


@pytest.mark.parametrize("target", TARGETS)
def test_norms_of_nan_and_infinities_equal_eager(target: str) -> None:
    x = torch.randn(4, 9)
    x[0, 0], x[1, 3], x[2, 5] = float("nan"), float("inf"), float("-inf")
    x = x.to(target_device(target))
    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(t, dim=1) + torch.linalg.vector_norm(t, ord=1, dim=1)

    torch._dynamo.reset()
    torch.testing.assert_close(rewritec.compile(fn, target=target, strict=True)(x), fn(x),
                               equal_nan=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(5, 17), (3, 4, 9)])
def test_normalize_gradients_equal_eager(target: str, shape: tuple) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape).to(target_device(target))
    w = torch.randn(*shape).to(target_device(target))
    check_grad(lambda t, w: (F.normalize(t, dim=-1) * w).sum(), x, target, w)
