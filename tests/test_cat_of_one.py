"""`cat` of one tensor and legacy empty ones compiles as a copy kernel
(aten/convert.py: _cat_of_one), the way Hugging Face's key-value cache starts."""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec import report


def _ops_outside() -> set[str]:
    return {op for r in report.RECORDS for op in r.fallback_ops}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["first", "last", "both"])
def test_a_cache_started_empty_is_a_copy_kernel(dtype, where) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        kv = x.view(2, 5, 3, 8).transpose(1, 2) * 2.0  # a strided view, as a cache's
        empty = torch.tensor([], dtype=dtype, device=x.device)
        parts = {"first": [empty, kv], "last": [kv, empty], "both": [empty, kv, empty]}
        return torch.cat(parts[where], dim=-2) + 0

    x = torch.randn(2, 5, 24).to(dtype)
    report.reset()
    got = rewritec.compile(step, strict=True)(x)
    want = step(x)
    assert got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got, want)
    assert "cat" not in _ops_outside(), _ops_outside()


def test_other_cats_are_no_copy() -> None:
    """An empty operand of another dtype (cat promotes to it) keeps ATen's cat and its
    results; two real operands are no copy either (a cat kernel computes them:
    tests/test_cat_kernels.py)."""
    def two(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x * 2.0], dim=0)

    def promoting(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([], dtype=torch.float32), x * 2], dim=0)

    x = torch.randn(3, 4).to(torch.bfloat16)
    for fn in (two, promoting):
        report.reset()
        got = rewritec.compile(fn)(x)
        torch.testing.assert_close(got, fn(x))
        assert got.dtype == fn(x).dtype
        assert not any("clone" in k["ops"] for r in report.RECORDS for k in r.kernels)
    assert "cat" in _ops_outside(), _ops_outside()
