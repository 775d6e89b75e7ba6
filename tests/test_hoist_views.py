"""Views moved above pointwise work (rules/simplify/hoist_views.yaml) and below a
softmax (softmax-of-view): a windowed attention's scores, plus a relative position
bias, viewed to add the shifted windows' mask, viewed back for the softmax, are one
row kernel. Differential against eager on every kernel target, forward and
backward, over dtypes; and the shape each operand takes (engine/guards.py:
broadcast_view), where a view can read it and where none can."""

from __future__ import annotations

import pytest
import torch

from models import kernel_targets, outside_ops, rules_fired, tol
from rewritec import report
from rewritec.engine.guards import broadcast_view
from rewritec.engine.term import Meta, Term, TermStore
from test_kernels import _check

DEVICE, TARGETS = kernel_targets()


def _term(shape: tuple[int, ...]) -> Term:
    return TermStore().make("input", (), (("name", "x"),), meta=Meta(shape=shape))


@pytest.mark.parametrize("y, t, size, want", [
    ((1, 3, 4, 4), (6, 3, 4, 4), [2, 3, 3, 4, 4], (1, 1, 3, 4, 4)),    # split a broadcast dim
    ((6, 3, 4, 4), (6, 3, 4, 4), [-1, 3, 3, 4, 4], (2, 3, 3, 4, 4)),   # the full operand
    ((4, 1), (2, 3, 4, 7), [6, 4, 7], (1, 4, 1)),                      # merge two broadcast dims
    ((7,), (2, 3, 4, 7), [-1, 7], (1, 7)),                             # fewer dims than t
    ((1, 3, 1, 4, 4), (2, 3, 5, 4, 4), [6, 5, 4, 4], None),            # part of a merged dim
    ((3, 1), (3, 4), [12], None),
    ((1, 1), (3, 4), [12], (1,)),
    ((3, 4), (3, 4), [2, 6], (2, 6)),                                   # regrouped, full
    ((3, 1), (3, 4), [2, 6], None),                                     # regrouped, part
    ((1, 5), (1, 1, 5), [5, 1], (5, 1)),                                # size-1 dims around
])
def test_broadcast_view(y, t, size, want) -> None:
    assert broadcast_view(_term(y), _term(t), size) == want


def _window_scores(s: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """timm's WindowAttention between its two products: [B*W, H, N, N] scores."""
    w, h, n = mask.shape[0], s.shape[1], s.shape[-1]
    s = s + bias.unsqueeze(0)
    s = s.view(-1, w, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
    return torch.softmax(s.view(-1, h, n, n), dim=-1)


def _inputs(dtype: torch.dtype, b: int = 2, w: int = 4, h: int = 3, n: int = 9):
    g = torch.Generator().manual_seed(n)
    s = torch.randn(b * w, h, n, n, generator=g).to(DEVICE, dtype)
    bias = torch.randn(h, n, n, generator=g).to(DEVICE, dtype)
    mask = torch.where(torch.rand(w, n, n, generator=g) < 0.3, -100.0, 0.0).to(DEVICE, dtype)
    return s, bias, mask


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_window_attention_scores_are_one_kernel(target: str, dtype: torch.dtype) -> None:
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("OpenMP kernels compute no f16")
    s, bias, mask = _inputs(dtype)
    _check(_window_scores, target, s, bias, mask, grad=dtype == torch.float32,
           tol=tol(dtype)["rtol"])
    forward = report.RECORDS[0]
    assert len(forward.kernels) == 1, [k["ops"] for k in forward.kernels]
    assert forward.kernels[0]["ops"].get("add") == 2, forward.kernels[0]["ops"]
    fired = rules_fired()
    assert fired["softmax-of-view"] == 1 and fired["view-of-add"] == 1, fired
    assert not {"add", "softmax", "_softmax"} & set(outside_ops()), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
def test_a_mask_across_the_merged_batch_keeps_its_view(target: str) -> None:
    """Viewed back to [B*W, H, N, N] the mask varies along part of the merged dim: no
    view of it reads it so, the view stays where it was, and the result is eager's."""
    s, bias, mask = _inputs(torch.float32)

    def scores(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w, h, n = mask.shape[0], s.shape[1], s.shape[-1]
        t = s.view(-1, w, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
        return torch.exp(t.view(-1, h, n, n) * 0.5) + 1.0

    _check(scores, target, s, mask, grad=True)
    assert not rules_fired()["view-of-add"]


@pytest.mark.parametrize("target", TARGETS)
def test_computed_operands_keep_their_views(target: str) -> None:
    """A view of a product of computed values (a gelu's halves) is not moved onto them:
    a view of values a kernel computes splits it (GPT-2's gelu went from one kernel to
    three that way), so the view stays, and the result is eager's."""
    x = torch.randn(4, 6, 8, device=DEVICE)

    def f(x: torch.Tensor) -> torch.Tensor:
        return ((torch.tanh(x) * 0.5) * (torch.exp(x) + 1.0)).view(24, 8) * 3.0

    _check(f, target, x, grad=True)
    assert not rules_fired()["view-of-mul"]
