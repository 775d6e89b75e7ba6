"""torch.index_select, and torch.roll (which decomposes to an index_select per rolled
dim), as takes (rules/decompose/gathers.yaml, index-select-as-take): computed in
kernels instead of ATen's gathers (a Swin-T inference step ran 20 index_selects in
ATen). Differential against eager over dims, index dtypes and lengths, forward and
backward, on both kernel targets."""

from __future__ import annotations

import pytest
import torch

import rewritec
from models import check_grad, kernel_targets, outside_ops, rules_fired, tol
from rewritec import report

DEVICE, TARGETS = kernel_targets()


def _compare(fn, target: str, x: torch.Tensor, *rest: torch.Tensor) -> None:
    """`fn` against eager, its value and the gradient of x (models.check_grad), with
    no index_select left to ATen."""
    report.reset()
    check_grad(fn, x, target, *rest, **tol(x.dtype))
    assert "index_select" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_index_select_matches_eager(target, dim, index_dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 6, 7, device=DEVICE)
    index = torch.randint(0, x.shape[dim], (9,), device=DEVICE, dtype=index_dtype)
    _compare(lambda x, i: torch.index_select(x, dim, i) * 2.0, target, x, index)
    assert rules_fired()["index-select-as-take"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_index_select_of_one_position(target) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, device=DEVICE)
    index = torch.tensor(2, device=DEVICE)  # 0-d: the dim keeps size 1
    # forward only: torch traces the gradient of a 0-d index_select to an index_put
    # that refuses its own values ("shape mismatch"), whatever the backend compiles
    fn = lambda x, i: torch.index_select(x, 1, i) + 1.0  # noqa: E731
    report.reset()
    torch._dynamo.reset()
    torch.testing.assert_close(rewritec.compile(fn, target=target, strict=True)(x, index),
                               fn(x, index))
    assert "index_select" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shifts,dims", [((-2, -2), (1, 2)), ((3,), (0,)), ((1, -1), (0, 3))],
                         ids=str)
def test_roll_matches_eager(target, dtype, shifts, dims) -> None:
    """A shifted window's roll, and its inverse after the window's work."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 8, 6, device=DEVICE).to(dtype)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(x, shifts=shifts, dims=dims) * 0.5 + 1.0
        return torch.roll(y, shifts=tuple(-s for s in shifts), dims=dims) + x

    _compare(shifted, target, x)
    forward = report.RECORDS[0]  # two rolls of each dim; the backward rolls back
    assert forward.rules_fired["index-select-as-take"] == 2 * len(dims)
