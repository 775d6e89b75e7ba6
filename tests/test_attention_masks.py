"""Attention masks copied contiguous before AOTAutograd (frontend/attention_masks.py),
so that torch's fused attention, not its math path, runs a broadcast padding mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report
from rewritec.frontend import attention_masks


def _padding_mask(pad: torch.Tensor, t: int) -> torch.Tensor:
    """A mask built by broadcasting, whose last dim has stride 0 as Hugging Face's
    BERT-style masks have under torch.compile; it masks out whole query rows, which
    the math path zeroes (`pad` bool: a bool mask; float: an additive one)."""
    return pad[:, None, :, None].expand(pad.shape[0], 1, t, t)


def _pads(n: int, t: int, additive: bool, device: str = "cpu") -> torch.Tensor:
    pad = torch.rand(n, t, device=device) > 0.3
    pad[:, 0] = True
    pad[:, 1] = False  # a fully masked query row in every sequence
    if additive:
        return torch.where(pad, 0.0, float("-inf"))
    return pad


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor,
            positional: bool) -> torch.Tensor:
    m = _padding_mask(pad, q.shape[-2])
    if positional:
        return F.scaled_dot_product_attention(q, k, v, m)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)


def _copies(fn, *args):
    """Compile `fn` with a backend that applies the pass: how many masks it copied
    in each TorchDynamo graph, and the compiled function's result."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(attention_masks.contiguous_attention_masks(gm))
        counts.append(attention_masks.contiguous_attention_masks(gm))  # now dense: 0
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*args)
    return counts, out


@pytest.mark.parametrize("positional", [False, True])
def test_a_broadcast_mask_is_copied_and_a_dense_one_left(monkeypatch, positional) -> None:
    monkeypatch.setattr(attention_masks, "FUSED_MASK_DEVICES", ("cpu",))
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))
    pad = torch.rand(2, 8) > 0.3
    counts, out = _copies(lambda q, k, v, p: _attend(q, k, v, p, positional), q, k, v, pad)
    assert counts == [1, 0]
    torch.testing.assert_close(out, _attend(q, k, v, pad, positional))
    dense = _padding_mask(pad, 8).contiguous()
    counts, _ = _copies(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                        q, k, v, dense)
    assert counts == [0, 0]
    counts, _ = _copies(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert counts == [0, 0]


def test_not_on_the_cpu_by_default() -> None:
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))
    counts, _ = _copies(lambda q, k, v, p: _attend(q, k, v, p, False), q, k, v,
                        torch.rand(2, 8) > 0.3)
    assert counts == [0, 0]


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_trains_like_eager(monkeypatch, dtype, additive) -> None:
    """Copied, results and gradients equal eager's, fully masked rows included."""
    monkeypatch.setattr(attention_masks, "FUSED_MASK_DEVICES", ("cpu",))
    torch.manual_seed(0)
    pad = _pads(2, 12, additive).to(dtype if additive else torch.bool)
    base = [torch.randn(2, 4, 12, 16, dtype=dtype) for _ in range(3)]
    mine = [t.clone().requires_grad_() for t in base]
    ref = [t.clone().requires_grad_() for t in base]
    got = rewritec.compile(lambda q, k, v, p: _attend(q, k, v, p, False))(*mine, pad)
    want = _attend(*ref, pad, False)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)
    got.float().square().sum().backward()
    want.float().square().sum().backward()
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_a_padding_mask_runs_fused_attention(dtype, additive) -> None:
    """The graphs call torch's fused attention (no batched products of the math
    path), forward and backward, with eager's results (eager runs the math path on
    this mask), fully masked rows included."""
    torch.manual_seed(0)
    pad = _pads(4, 128, additive, "cuda").to(dtype if additive else torch.bool)
    base = [torch.randn(4, 8, 128, 64, device="cuda", dtype=dtype) for _ in range(3)]
    mine = [t.clone().requires_grad_() for t in base]
    ref = [t.clone().requires_grad_() for t in base]
    report.reset()
    got = rewritec.compile(lambda q, k, v, p: _attend(q, k, v, p, False))(*mine, pad)
    want = _attend(*ref, pad, False)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    want.float().sum().backward()
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=3e-2, atol=3e-2)
    ops = {op for r in report.RECORDS for op in r.fallback_ops}
    assert "bmm" not in ops and any("scaled_dot_product" in op for op in ops), ops


class _Masked(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pad: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v, pad, False)


def test_the_export_path_copies_the_mask_too(monkeypatch) -> None:
    """An exported program's graph gets the same rewrite (frontend/export.py), with
    eager's results, fully masked rows included."""
    from rewritec.frontend.export import export_and_compile
    from rewritec.options import Options

    monkeypatch.setattr(attention_masks, "FUSED_MASK_DEVICES", ("cpu",))
    seen = []
    real = attention_masks.contiguous_attention_masks
    monkeypatch.setattr("rewritec.frontend.export.contiguous_attention_masks",
                        lambda gm: seen.append(real(gm)) or seen[-1])
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    pad = _pads(2, 12, False)
    got = export_and_compile(_Masked(), (q, k, v, pad), Options.make())(q, k, v, pad)
    torch.testing.assert_close(got, _attend(q, k, v, pad, False))
    assert seen == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_export_path_runs_fused_attention() -> None:
    from rewritec.frontend.export import export_and_compile
    from rewritec.options import Options

    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 8, 128, 64, device="cuda", dtype=torch.float16)
               for _ in range(3))
    pad = _pads(4, 128, False, "cuda")
    report.reset()
    got = export_and_compile(_Masked(), (q, k, v, pad), Options.make())(q, k, v, pad)
    torch.testing.assert_close(got, _attend(q, k, v, pad, False), rtol=2e-2, atol=2e-2)
    ops = {op for r in report.RECORDS for op in r.fallback_ops}
    assert "bmm" not in ops and any("scaled_dot_product" in op for op in ops), ops
