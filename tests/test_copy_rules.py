"""The copy rules (rules/simplify/casts.yaml): the copies
AOTAutograd writes for an in-place update of a view (T5's `scores += position_bias`)
leave the backward, and the gradients stay eager's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rewritec import report

COPY_RULES = ["copy-self", "copy-same-layout", "copy-into-fresh", "copy-onto-fill", "copy-of-0d"]


def attention_scores(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(x, x.transpose(-1, -2))
    heads = scores.view(x.shape[0] // bias.shape[0], bias.shape[0], *scores.shape[1:])
    heads += bias  # in place, on a view
    return torch.softmax(scores, -1).sum()


def run(fn, x, bias, options):
    x, bias = x.clone().requires_grad_(), bias.clone().requires_grad_()
    loss = fn(x, bias) if options is None else \
        torch.compile(fn, backend="rewritec", options=options)(x, bias)
    loss.backward()
    return loss, x.grad, bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,t,d", [(4, 2, 8, 5), (6, 3, 7, 16)])
def test_the_copies_of_an_in_place_update_of_a_view_leave(dtype, batch, heads, t, d) -> None:
    torch._dynamo.reset()
    x = torch.randn(batch, t, d).to(dtype)
    bias = torch.randn(heads, t, t).to(dtype)
    want = run(attention_scores, x, bias, None)
    outside = {}
    for disabled in ([], COPY_RULES):
        torch._dynamo.reset()
        report.reset()
        got = run(attention_scores, x, bias, {"disable": disabled})
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {}
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **tol)
        outside[bool(disabled)] = sum((r.fallback_ops for r in report.RECORDS), start=Counter())
        fired = {rule for r in report.RECORDS for rule in r.rules_fired}
        # both copies are of a value laid out as where it goes (a contiguous fresh
        # tensor, then the value itself): copy-same-layout takes them
        assert disabled or "copy-same-layout" in fired, fired
    assert outside[True]["copy"] == 2 and outside[True]["new_empty_strided"] == 1
    assert outside[False]["copy"] == 0 and outside[False]["new_empty_strided"] == 0


def shift_right(labels: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """T5's _shift_right: the labels one column right, the start token first,
    ignored labels (-100) as padding (0)."""
    shifted = labels.new_zeros(labels.shape)
    shifted[..., 1:] = labels[..., :-1].clone()
    shifted[..., 0] = start
    return shifted.masked_fill(shifted == -100, 0)


@pytest.mark.parametrize("target", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2, 32), (3, 5, 7)], ids=str)
def test_a_0d_value_copied_into_a_column_joins_the_kernel(target, dtype, shape) -> None:
    """copy-of-0d: the start token written into the first column is a 0-d value
    broadcast, computed inside the kernel that writes the shifted labels."""
    import os

    if target == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    torch.manual_seed(len(shape))
    labels = torch.randint(-1, 50, shape).to(dtype)
    labels[..., ::3] = -100
    start = torch.tensor(7, dtype=dtype)
    report.reset()
    torch._dynamo.reset()
    got = torch.compile(shift_right, backend="rewritec",
                        options={"target": target, "strict": True})(labels, start)
    torch.testing.assert_close(got, shift_right(labels, start))
    fired = sum((Counter(r.rules_fired) for r in report.RECORDS), Counter())
    outside = sum((Counter(r.fallback_ops) for r in report.RECORDS), Counter())
    assert fired["copy-of-0d"] == 1 and "copy" not in outside, (fired, outside)
