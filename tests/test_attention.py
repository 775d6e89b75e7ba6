"""Attention: the recognize rules (rules/recognize/attention.yaml) and the Triton
flash-attention template (rule fuse-attention), against eager.

Without a GPU the Triton kernels run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1); with one, the same tests run on CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import rewritec
import torch
from rewritec import report
from torch import nn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1")

# The kernel keeps the scores in f32 and rounds the unnormalized probabilities for the
# second product, eager rounds the normalized ones: half-precision rounding apart.
# The interpreter also truncates bf16 stores (tests/regressions, BF16_TRUNCATION).
TOL = {torch.float16: 2e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


class SelfAttention(nn.Module):
    """GPT-2's attention: one projection split into heads, a causal (or given)
    boolean mask applied with masked_fill, the heads merged back."""

    def __init__(self, dim: int, heads: int, t: int, mask: str = "causal") -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.mask_kind = mask
        if mask == "causal":
            keep = torch.tril(torch.ones(t, t, dtype=torch.bool))
        elif mask == "random":
            keep = torch.rand(t, t, generator=torch.Generator().manual_seed(t)) < 0.7
            keep[:, 0] = True  # every query keeps a key (rows of nothing are tested apart)
        else:
            keep = torch.ones(t, t, dtype=torch.bool)
        self.register_buffer("keep", keep, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if self.mask_kind != "none":
            att = att.masked_fill(~self.keep[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).contiguous().view(b, t, c)


def attention_kernels() -> list[dict]:
    return [k for r in report.RECORDS for k in r.kernels if k["rules"] == ["fuse-attention"]]


def fired(rule: str) -> int:
    return sum(r.rules_fired.get(rule, 0) for r in report.RECORDS)


def run(model: nn.Module, x: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled and eager results (Triton kernels unless `target` says otherwise)."""
    options.setdefault("target", "triton")
    report.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        got = rewritec.compile(model, strict=True, **options)(x)
        want = model(x)
    return got, want


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "random", "none"])
@pytest.mark.parametrize("b,t,dim,heads", [(2, 33, 64, 4), (1, 7, 64, 2), (1, 1, 32, 2)])
def test_self_attention_kernel(b: int, t: int, dim: int, heads: int, mask: str,
                               dtype: torch.dtype) -> None:
    """One kernel per attention, reading q, k, v straight from the projection (no
    copies), sizes that leave partial blocks, head dims 16/32/16."""
    torch.manual_seed(t)
    model = SelfAttention(dim, heads, t, mask).to(DEVICE, dtype).eval()
    x = torch.randn(b, t, dim, device=DEVICE, dtype=dtype)
    got, want = run(model, x)
    rule = "attention-masked" if mask != "none" else "attention"
    assert fired(rule if b > 1 else f"{rule}-views") == 1  # B = 1: operands merged by views
    kernels = attention_kernels()
    assert len(kernels) == 1, [k["rules"] for r in report.RECORDS for k in r.kernels]
    with open(kernels[0]["source"]) as f:
        source = f.read()
    assert "rule: fuse-attention @ rules/fuse/kernels.yaml" in source
    # the head split and merge are views of the kernel's operands and result
    # no copy kernel either; the mask's `~keep` (a bool result) is a kernel of its
    # own, as it was one ATen op
    assert fired("fuse-pointwise") == (0 if mask == "none" else 1)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_causal_mask_skips_the_mask() -> None:
    """A frozen tril mask (freeze=True: the mask buffer is then a constant) is
    recognized as causal: the kernel masks by index."""
    model = SelfAttention(32, 2, 40, "causal").to(DEVICE, torch.float16).eval()
    x = torch.randn(2, 40, 32, device=DEVICE, dtype=torch.float16)
    import dataclasses

    from rewritec.kinds import registry

    seen: list[bool] = []
    kind = registry.KINDS["attention"]
    assert kind.spec is not None
    spec = kind.spec

    def spy(term, index):
        out = spec(term, index)
        seen.append(out.meta["causal"])
        return out

    registry.KINDS["attention"] = dataclasses.replace(kind, spec=spy)
    try:
        got, want = run(model, x, freeze=True)
    finally:
        registry.KINDS["attention"] = kind
    # the variants pass asks for the spec too, then runtime/prepare.py
    assert seen and all(seen)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dk,dv,kernel", [(16, 32, True), (8, 12, False)],
                         ids=["heads-16-32", "heads-8-12"])
def test_cross_attention_broadcast_mask(dtype: torch.dtype, dk: int, dv: int,
                                        kernel: bool) -> None:
    """Tq != Tk, a per-batch mask broadcast over heads, key and value head dims that
    differ. Head dims that are not whole 16s stay with ATen (fuse-attention's guard:
    one such kernel read out of bounds on an H100), with eager's result."""

    def f(q, k, v, drop):
        s = (q @ k.transpose(-2, -1)) * 0.3
        return torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1) @ v

    g = torch.Generator(device=DEVICE).manual_seed(5)
    q = torch.randn(2, 3, 9, dk, device=DEVICE, dtype=dtype, generator=g).transpose(1, 2)
    q = q.transpose(1, 2)  # strided, not contiguous
    k = torch.randn(2, 3, 21, dk, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(2, 3, 21, dv, device=DEVICE, dtype=dtype, generator=g)
    drop = torch.rand(2, 1, 9, 21, device=DEVICE, generator=g) < 0.3
    drop[..., 0] = False
    report.reset()
    got = rewritec.compile(f, strict=True, target="triton")(q, k, v, drop)
    want = f(q, k, v, drop)
    assert len(attention_kernels()) == int(kernel)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_fully_masked_row_is_nan_as_in_eager() -> None:
    def f(q, k, v, drop):
        s = (q @ k.transpose(-2, -1)) * 0.5
        return torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 5, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    drop = torch.zeros(5, 5, dtype=torch.bool, device=DEVICE)
    drop[2] = True  # query 2 attends to nothing: softmax of all -inf is nan
    got = rewritec.compile(f, strict=True, target="triton")(q, k, v, drop)
    want = f(q, k, v, drop)
    assert len(attention_kernels()) == 1
    assert torch.isnan(want[:, :, 2]).all() and torch.isnan(got[:, :, 2]).all()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, equal_nan=True)


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_without_a_kernel_attention_runs_as_aten(mask: str) -> None:
    """f32, or the OpenMP target: recognized, no kernel, eager's exact results."""
    model = SelfAttention(32, 2, 12, mask).to(DEVICE).eval()
    x = torch.randn(2, 12, 32, device=DEVICE)
    got, want = run(model, x, target="auto")
    assert fired("attention-masked" if mask == "causal" else "attention") == 1
    assert attention_kernels() == []
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_training_graph_is_left_alone() -> None:
    """The probabilities are saved for the backward: recognizing the forward would
    compute them twice, so the rule's guard (users(p) == 1) refuses."""
    model = SelfAttention(32, 2, 12).to(DEVICE)
    x = torch.randn(2, 12, 32, device=DEVICE, requires_grad=True)
    report.reset()
    got = rewritec.compile(model, strict=True)(x)
    got.sum().backward()
    grad, x.grad = x.grad, None
    want = model(x)
    want.sum().backward()
    assert fired("attention-masked") == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)
