"""`scalar_tensor(v)` (what `torch.where(c, x, 0)` and masked fills trace to) reaches
the op table's ops as the number v: a literal inside their kernel, not an ATen fill
and a kernel input. Where a number would promote differently from the 0-dim tensor
(another dtype, no tensor operand left), the scalar_tensor stays. Results against
eager over dtypes, forward and backward."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import rewritec
from models import rules_fired
from rewritec import report

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _compiled(fn, *args, target: str = "auto"):
    torch._dynamo.reset()
    start = len(report.RECORDS)
    got = rewritec.compile(fn, target=target)(*args)
    outside: Counter[str] = Counter()
    for r in report.RECORDS[start:]:
        outside.update(r.fallback_ops)
    return got, outside, sum(len(r.kernels) for r in report.RECORDS[start:])


def masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, 0) * 2 + torch.where(x > 0, 3, x)


def both_scalars(x: torch.Tensor) -> torch.Tensor:
    # a mask of two numbers: the result's dtype comes from the 0-dim tensors
    return torch.where(x > 0, torch.tensor(0.0, dtype=x.dtype), float("-inf")) + x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 7), (3, 1, 33)], ids=str)
def test_where_with_a_number_matches_eager(dtype, shape) -> None:
    x = (torch.randn(*shape) * 4).to(dtype)
    m = torch.rand(*shape) > 0.5
    got, outside, kernels = _compiled(masked, x, m)
    want = masked(x, m)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    assert "scalar_tensor" not in outside, outside
    if dtype in (torch.float32, torch.bfloat16):  # no integers; f16 stays with ATen
        assert kernels == 1 and not outside, outside


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_numbers_keep_the_tensors_dtype(dtype) -> None:
    x = torch.randn(4, 9).to(dtype)
    got, _, _ = _compiled(both_scalars, x)
    want = both_scalars(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)


def test_a_where_outside_kernels_reads_the_number() -> None:
    """No kernel takes it (kernels compute no int16): ATen's where.ScalarOther
    runs it, with the number, not a 0-dim tensor."""
    x, m = torch.randint(-9, 9, (6, 5), dtype=torch.int16), torch.rand(6, 5) > 0.5
    got, outside, kernels = _compiled(lambda a, b: torch.where(b, a, 0), x, m)
    torch.testing.assert_close(got, torch.where(m, x, 0))
    assert kernels == 0 and outside == Counter({"where": 1})


def test_an_op_without_a_number_overload_keeps_the_tensor() -> None:
    """maximum has no Scalar overload: it reads the 0-dim tensor, as traced, which
    is a fill (rules/decompose/fills.yaml) the kernel computes inline: no launch."""
    x = torch.randn(6, 5)

    def fn(a):
        return torch.maximum(a, torch.scalar_tensor(0.25)) * 2

    got, outside, _ = _compiled(fn, x)
    torch.testing.assert_close(got, fn(x))
    assert not outside["scalar_tensor"] and not outside["full"], outside
    assert "scalar-tensor-as-full" in rules_fired()


@pytest.mark.parametrize("target", ["auto"] + (["triton"] if INTERPRETED else []))
def test_a_cross_entropy_reads_no_zero_tensor(target) -> None:
    """The class-index loss's decomposition writes where(..., 0) four times."""
    logits = torch.randn(6, 40, requires_grad=True)
    ref = logits.detach().clone().requires_grad_()
    t = torch.randint(40, (6,))
    t[::3] = -100

    def loss(a, b):
        return F.cross_entropy(a, b)

    start = len(report.RECORDS)
    got, _, _ = _compiled(loss, logits, t, target=target)
    want = loss(ref, t)
    torch.testing.assert_close(got, want)
    (g,), (r,) = torch.autograd.grad(got, [logits]), torch.autograd.grad(want, [ref])
    torch.testing.assert_close(g, r)
    records = report.RECORDS[start:]
    assert {r.kind for r in records} == {"forward", "backward"}
    for rec in records:
        assert "scalar_tensor" not in rec.fallback_ops, (rec.kind, rec.fallback_ops)
