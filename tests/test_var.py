"""var and std inside kernels (rules/decompose/reductions.yaml: var, -default-correction,
-half): ATen ran them, outside every kernel. Differential against eager on both targets:
dims, keepdim, corrections, dtypes, a transposed input, gradients, and a reduction of
one value (n - correction = 0: nan, as ATen gives)."""

from __future__ import annotations

import pytest
import torch

from models import check_grad, target_device, target_params

import rewritec
from rewritec import report

TARGETS = target_params()
CASES = {
    "rows": lambda x: torch.var(x, dim=-1) * 2.0,
    "keepdim": lambda x: x - torch.var(x, dim=1, keepdim=True),
    "biased": lambda x: torch.var(x, dim=0, correction=0) + 1.0,
    "all": lambda x: torch.var(x) * 1.0,
    "std": lambda x: torch.std(x, dim=-1, keepdim=True) * x,
    "two_dims": lambda x: torch.var(x, dim=(0, -1), correction=2) * 1.0,
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transposed", [False, True])
def test_var_in_kernels_equals_eager(target: str, case: str, dtype: torch.dtype,
                                     transposed: bool) -> None:
    if target == "openmp" and dtype == torch.bfloat16:
        pytest.skip("the OpenMP target computes f32 and f64 only")
    torch.manual_seed(0)
    x = (torch.randn(6, 37) * 3.0 + 5.0).to(dtype).to(target_device(target))
    x = x.t() if transposed else x
    fn = CASES[case]
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(x)
    want = fn(x)
    # bf16: eager rounds var to bf16 before the op after it, a kernel rounds once at
    # the end; at values near 10 one bf16 step is 0.0625
    tol = {"rtol": 2e-2, "atol": 0.125} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)
    assert not [r.fallback_ops for r in report.RECORDS if "var" in r.fallback_ops]
    assert sum(r.rules_fired.get("var", 0) for r in report.RECORDS) == 1


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(5, 17), (3, 4, 9)])
def test_std_gradients_equal_eager(target: str, shape: tuple) -> None:
    torch.manual_seed(0)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return ((t - t.mean(-1, keepdim=True)) / torch.std(t, dim=-1, keepdim=True)).pow(2).sum()

    check_grad(fn, torch.randn(*shape).to(target_device(target)), target)


def test_var_of_one_value_is_nan_as_aten_gives() -> None:
    x = torch.randn(4, 1)
    fn = lambda t: torch.var(t, dim=1) + 0.0  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(rewritec.compile(fn, target="openmp", strict=True)(x), fn(x),
                               equal_nan=True)
