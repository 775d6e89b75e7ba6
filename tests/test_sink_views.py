"""Transposes moved below the pointwise work they view (rules/simplify/sink_views.yaml):
the copy that makes attention's heads contiguous again (`clone(transpose(...))`)
computes the rotary embedding, or its gradient, in the same kernel. Against eager on
every kernel target, over dtypes and shapes, forward and backward."""

from __future__ import annotations

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, rules_fired
from rewritec import report

DEVICE, TARGETS = kernel_targets()


def _rotate(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def heads_out(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              w: torch.Tensor) -> torch.Tensor:
    """A rotary embedding over [B, H, S, D], the heads put back as [B, S, H * D] (a
    copy), then a projection: what an attention block does to its queries' gradient
    path, forward and backward."""
    y = q * cos + _rotate(q) * sin
    y = y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    return y @ w


def _compiled(fn, target):
    report.reset()
    torch._dynamo.reset()
    return torch.compile(fn, backend="rewritec", options={"target": target})


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal in f32; in halves, within 2% of the result's scale (Triton's interpreter
    rounds to bf16 by truncation, which a sum over a product's inner dim adds up)."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("b", "h", "s", "d"), [(2, 4, 8, 16), (1, 3, 5, 8)])
def test_a_rotary_embedding_and_its_head_copy_are_one_kernel(target, dtype, b, h, s, d) -> None:
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("OpenMP kernels compute no f16 (kinds/kernels.py: CPP_DTYPES)")
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    cos = torch.randn(1, 1, s, d, device=DEVICE, dtype=dtype)
    sin = torch.randn(1, 1, s, d, device=DEVICE, dtype=dtype)
    w = torch.randn(h * d, 12, device=DEVICE, dtype=dtype, requires_grad=True)
    compiled = _compiled(heads_out, target)
    got = compiled(q, cos, sin, w)
    want = heads_out(q, cos, sin, w)
    _close(got, want)
    grad = torch.randn_like(got)
    got_q, got_w = torch.autograd.grad(got, (q, w), grad)
    want_q, want_w = torch.autograd.grad(want, (q, w), grad)
    _close(got_q, want_q)
    _close(got_w, want_w)
    forward = next(r for r in report.RECORDS if r.kind == "forward")
    assert len(forward.kernels) == 1, [k["ops"] for k in forward.kernels]
    ops = forward.kernels[0]["ops"]
    assert ops.get("clone") == 1 and ops.get("cat") == 1, ops
    assert {"transpose-of-add", "transpose-of-cat"} <= set(rules_fired())


@pytest.mark.parametrize("target", TARGETS)
def test_the_gradient_of_a_rotary_embedding_and_its_copy_are_one_kernel(target) -> None:
    """The backward's shape of the same thing: the gradient of a rotary embedding
    (slice_backward of the halves), made contiguous in [B, S, H, D]."""
    def fn(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = g.shape[-1] // 2
        gs = (g * sin).to(torch.bfloat16)
        rot = torch.ops.aten.slice_backward(-gs[..., :h], g.shape, 3, h, 2 * h, 1) + \
            torch.ops.aten.slice_backward(gs[..., h:], g.shape, 3, 0, h, 1)
        y = rot + (g * cos).to(torch.bfloat16)
        return y.transpose(1, 2).contiguous()

    g = torch.randn(2, 3, 6, 8, device=DEVICE)
    cos, sin = torch.randn(1, 1, 6, 8, device=DEVICE), torch.randn(1, 1, 6, 8, device=DEVICE)
    got = _compiled(fn, target)(g, cos, sin)
    want = fn(g, cos, sin)
    assert got.is_contiguous() and got.dtype == torch.bfloat16
    _close(got, want)
    (rec,) = report.RECORDS
    assert len(rec.kernels) == 1, [k["ops"] for k in rec.kernels]
    assert "transpose-of-slice-backward" in rules_fired()


@pytest.mark.parametrize("target", TARGETS)
def test_work_read_twice_or_an_innermost_transpose_stays(target) -> None:
    """A transpose of work something else also reads is not moved (the work would be
    computed twice), nor one that moves the innermost dim (reads would stride)."""
    def twice(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x * y
        return s.transpose(1, 2).contiguous(), s.sum()

    def inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).transpose(2, 3).contiguous()

    x, y = torch.randn(2, 3, 4, 5, device=DEVICE), torch.randn(2, 3, 4, 5, device=DEVICE)
    for fn in (twice, inner):
        got = _compiled(fn, target)(x, y)
        torch.testing.assert_close(got, fn(x, y))
        assert "transpose-of-mul" not in rules_fired(), fn.__name__


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_grouped_key_gradient_is_summed_and_reordered_in_one_kernel(target, dtype) -> None:
    """Grouped-query attention's key or value gradient: the query heads' gradients
    summed over each group (keepdim, then squeezed: squeeze-of-keepdim-sum), the heads
    put back in order for the projection's backward (transpose-of-sum): one reduction
    kernel reading the gradients transposed."""
    def fn(g: torch.Tensor) -> torch.Tensor:
        b, h, s, d = g.shape
        grouped = g.view(b, 2, h // 2, s, d).sum(2, keepdim=True).squeeze(2)
        return grouped.transpose(1, 2).contiguous().view(b, s, -1)

    g = torch.randn(2, 6, 5, 8, device=DEVICE, dtype=dtype)
    got = _compiled(fn, target)(g)
    _close(got, fn(g))
    (rec,) = report.RECORDS
    assert len(rec.kernels) == 1, [k["ops"] for k in rec.kernels]
    assert {"squeeze-of-keepdim-sum", "transpose-of-sum"} <= set(rules_fired())


@pytest.mark.parametrize("target", TARGETS)
def test_a_rows_sum_keeps_its_dims_for_the_row_kernel(target) -> None:
    """A cross entropy picks its target logit as a row's sum with keepdim, squeezed:
    the keepdim rules leave row sums alone, so it stays one row kernel (with them
    dropping the kept dim there, the loss's forward was three kernels)."""
    import torch.nn.functional as F

    logits = torch.randn(6, 40, device=DEVICE)
    target_ids = torch.randint(0, 40, (6,), device=DEVICE)

    def kernels(disable: list[str]) -> int:
        report.reset()
        torch._dynamo.reset()
        loss = torch.compile(F.cross_entropy, backend="rewritec",
                             options={"target": target, "disable": disable})
        torch.testing.assert_close(loss(logits, target_ids), F.cross_entropy(logits, target_ids))
        return sum(len(r.kernels) for r in report.RECORDS)

    assert kernels([]) == kernels(["squeeze-of-keepdim-sum", "view-of-keepdim-sum"])
