"""Folding in real models: conv+bn and linear+bn in eval mode become one
convolution / one addmm, results stay equal, and a later parameter update is seen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rewritec import report
from rewritec.testing import assert_fires


def _bn(bn: nn.modules.batchnorm._BatchNorm) -> None:
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)


def _aten_ops() -> dict[str, int]:
    ops: dict[str, int] = {}
    for r in report.RECORDS:
        for k, v in r.fallback_ops.items():
            ops[k] = ops.get(k, 0) + v
    return ops


def test_conv_bn_relu_eval_folds_to_one_convolution() -> None:
    torch.manual_seed(0)
    for bias in (False, True):
        m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.BatchNorm2d(8),
                          nn.ReLU()).eval()
        _bn(m[1])
        # a bias is an add after the convolution by then (conv-bias-as-add)
        rule = "conv-split-bias-affine-fold" if bias else "conv-nobias-affine-fold"
        report.reset()
        with torch.no_grad():
            # NCHW kept: this is about the fold; tests/test_layout.py covers NHWC
            assert_fires(rule, m, torch.randn(2, 3, 9, 7), times=1, conv_layout="keep",
                         freeze=True)
        # the folded bias is an add after the convolution, fused with the relu
        assert _aten_ops() == {"convolution": 1}
        assert [k["rules"] for r in report.RECORDS for k in r.kernels] == [["fuse-pointwise"]]


def test_linear_bn_eval_folds_to_one_addmm() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6)).eval()
    _bn(m[1])
    with torch.no_grad():
        assert_fires("linear-affine-fold", m, torch.randn(4, 5), times=1, freeze=True)
    assert _aten_ops() == {"addmm": 1}


def _conv_bn_eval() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)).eval()
    _bn(m[1])
    return m


def test_folded_conv_follows_an_in_place_update() -> None:
    m, x = _conv_bn_eval(), torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        compiled = torch.compile(m, backend="rewritec", options={"strict": True, "freeze": True})
        torch.testing.assert_close(compiled(x), m(x))
        m[0].weight.mul_(2.0)
        m[1].running_var.add_(1.0)
        torch.testing.assert_close(compiled(x), m(x))
    assert any("affine-fold" in k for r in report.RECORDS for k in r.rules_fired)


@pytest.mark.parametrize("update", ["data_mul", "data_assign", "copy_under_no_grad"])
def test_default_compilation_sees_every_weight_update(update) -> None:
    """Freezing is opt-in: by default the parameters stay graph inputs, so even a
    write through `.data` (EMA, weight clipping), which bumps no version counter the
    parameter shares, is seen. With freezing, swapping `.data` is caught by the
    data-pointer guard."""
    m, x = _conv_bn_eval(), torch.randn(1, 3, 8, 8)
    compiled = torch.compile(m, backend="rewritec", options={"strict": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
        w = m[0].weight
        if update == "data_mul":
            w.data.mul_(0.5)
        elif update == "data_assign":
            w.data = w.data * -1.0
        else:
            w.copy_(torch.randn_like(w))
        m[1].running_mean.data.add_(0.25)
        torch.testing.assert_close(compiled(x), m(x))


def test_frozen_compilation_sees_a_data_swap() -> None:
    m, x = _conv_bn_eval(), torch.randn(1, 3, 8, 8)
    compiled = torch.compile(m, backend="rewritec", options={"strict": True, "freeze": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
        m[0].weight.data = m[0].weight.data * -1.0
        torch.testing.assert_close(compiled(x), m(x))


def test_training_mode_never_folds() -> None:
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).train()
    compiled = torch.compile(m, backend="rewritec", options={"strict": True})
    compiled(torch.randn(2, 3, 4, 4)).sum().backward()
    fired = {k for r in report.RECORDS for k in r.rules_fired}
    assert not fired & {"conv-affine-fold", "conv-nobias-affine-fold", "fold-constants"}
