"""softmax-backward and softmax-backward-half (rules/decompose/norms.yaml) in
whole training graphs, against eager.

AOTAutograd keeps `_softmax_backward_data` whole; the rules write it as
y * (g - sum(g * y)), which fuses with the attention's scale and mask around it.
Each case compares outputs and input gradients with eager over shapes, softmax
dims, strides and dtypes, and checks that the backward graph no longer calls
the ATen op."""

from __future__ import annotations

import pytest
import torch

from rewritec import report

# a softmax over the last dim, over a middle one, and over a transposed input's first
CASES = [((4, 9), -1, False), ((3, 5, 7), 1, False), ((8, 3), 0, True)]
DTYPES = [(torch.float32, None), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)]


def attention_scores(x: torch.Tensor, w: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax of scaled, masked scores, then a weighted sum: the attention idiom."""
    s = torch.softmax((x * w).masked_fill(x > 2.0, -1e4), dim=dim)
    return s * x


@pytest.mark.parametrize(("dtype", "tol"), DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "dim", "transposed"), CASES, ids=str)
def test_softmax_backward_matches_eager(shape, dim, transposed, dtype, tol) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape[::-1]).transpose(0, -1) if transposed else torch.randn(shape)
    x = x.to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    mine = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
    ref = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
    start = len(report.RECORDS)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: attention_scores(a, b, dim), backend="rewritec",
                             options={"strict": True})
    got, want = compiled(*mine), attention_scores(*ref, dim)
    kw = {"rtol": tol, "atol": tol} if tol else {}
    torch.testing.assert_close(got, want, **kw)
    cot = torch.randn_like(want)
    for g, r in zip(torch.autograd.grad(got, mine, cot), torch.autograd.grad(want, ref, cot),
                    strict=True):
        torch.testing.assert_close(g, r, **kw)
    backward = [r for r in report.RECORDS[start:] if r.kind == "backward"]
    assert backward, "no backward graph compiled"
    for r in backward:
        assert "_softmax_backward_data" not in r.fallback_ops, r.fallback_ops
        assert r.rules_fired.get("softmax-backward", 0) == 1, r.rules_fired
