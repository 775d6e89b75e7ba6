"""rules/decompose/matmul_align.yaml: half-precision products with a dim that is
not a multiple of 8 are padded, multiplied aligned and sliced back; forward and
backward equal eager's, and the result is a view with the padded row stride."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", ["aten", "triton"])
@pytest.mark.parametrize("vocab", [1001, 1003])
def test_an_lm_head_with_an_odd_vocabulary(dtype: torch.dtype, target: str, vocab: int) -> None:
    if target == "triton" and not torch.cuda.is_available() \
            and (vocab, dtype) in ((1001, torch.float16), (1003, torch.bfloat16)):
        # the interpreter takes 12 s a case: two cases cover both pads and both dtypes
        pytest.skip("interpreted Triton: the other two cases cover this one's pad and dtype")
    torch.manual_seed(0)
    device = "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"
    x = torch.randn(300, 264).to(dtype).to(device)
    w = (torch.randn(vocab, 264) * 0.05).to(dtype).to(device)

    def head(x, w):
        return F.log_softmax(F.linear(x, w).float(), dim=-1)

    report.reset()
    torch._dynamo.reset()
    compiled = rewritec.compile(head, target=target, strict=True)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    xc, wc = x.double().requires_grad_(), w.double().requires_grad_()
    got, want, exact = compiled(xa, wa), head(xb, wb), head(xc, wc)
    cot = torch.randn_like(want)
    for out in (got, want, exact):
        out.backward(cot.to(out.dtype))
    # half products round their sums: the compiled result is held to eager's
    # distance from a float64 run of the same function, not to eager itself
    for c, e, ref in [(got, want, exact), (xa.grad, xb.grad, xc.grad),
                      (wa.grad, wb.grad, wc.grad)]:
        err = (c.double() - ref).abs().max().item()
        eager_err = (e.double() - ref).abs().max().item()
        assert err <= 3 * eager_err + 1e-3 * ref.abs().max().item(), (err, eager_err)
    fired = Counter()
    for r in report.RECORDS:
        fired.update(r.rules_fired)
    assert fired["pad-mm-columns"] == 1, fired
    # the backward's two products (their form depends on the trace: mm(t(g), x) or
    # t(mm(t(x), g))) are padded too
    assert fired["pad-mm-inner"] + fired["pad-mm-rows"] == 2, fired


def test_an_aligned_or_small_product_is_left_alone() -> None:
    for rows, vocab in [(300, 1000), (8, 1001)]:
        x, w = torch.randn(rows, 264).bfloat16(), torch.randn(vocab, 264).bfloat16()
        report.reset()
        torch._dynamo.reset()
        with torch.no_grad():
            got = rewritec.compile(F.linear, target="aten", strict=True)(x, w)
        torch.testing.assert_close(got, F.linear(x, w))
        assert not any("pad" in k for r in report.RECORDS for k in r.rules_fired)
