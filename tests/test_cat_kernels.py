"""`cat`, `slice_scatter` and `slice_backward` inside pointwise kernels
(kinds/indexed.py; rules fuse-pointwise and fuse-indexed). A rotary embedding as
Hugging Face's Llama writes it, `q * cos + cat(-q2, q1) * sin`, is one kernel, and
so is its gradient (two zero-padded halves added); cats of pieces of unequal sizes
along any dim, of strided inputs, and slices' gradients too. Against eager, forward
and backward, in f32, bf16, f16 and under CPU autocast; what a kernel cannot compute
(mixed dtypes, symbolic sizes, integers promoted to floats) still runs through ATen."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets
from rewritec import report

DEVICE, TARGETS = kernel_targets()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INDEXED = ("cat", "slice_scatter", "slice_backward")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def _cos_sin(b: int, t: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = torch.outer(torch.arange(t, device=DEVICE).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(b, t, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _compare(fn: Callable[..., object], inputs: list[torch.Tensor], target: str,
             dtype: torch.dtype, autocast: bool = False,
             dynamic: bool | None = None) -> collections.Counter[str]:
    """fn compiled for `target` against eager, outputs and the gradients of the
    inputs that require them; the ops left outside kernels."""
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rewritec", dynamic=dynamic,
                             options={"target": target, "strict": True})
    results = []
    for f in (fn, compiled):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = f(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.manual_seed(1)
        floats = [o for o in outs if o.is_floating_point()]
        wrt = [x for x in xs if x.requires_grad]
        grads = torch.autograd.grad(floats, wrt, [torch.randn_like(o) for o in floats]) \
            if wrt else ()
        results.append([o.detach() for o in outs] + list(grads))
    half = dtype != torch.float32 or autocast
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2 if half else 1e-5,
                                   atol=2e-2 if half else 1e-5)
    outside: collections.Counter[str] = collections.Counter()
    for rec in report.RECORDS:
        outside.update(rec.fallback_ops)
    return outside


def _computes(dtype: torch.dtype, target: str) -> bool:
    """f16 stays with ATen on the CPU (kinds/kernels.py: CPP_DTYPES)."""
    return dtype != torch.float16 or target == "triton"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_is_one_kernel_forward_and_backward(target: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 5, 8
    q = torch.randn(b, h, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    cos, sin = _cos_sin(b, t, d, dtype)
    outside = _compare(apply_rotary_pos_emb, [q, k, cos, sin], target, dtype)
    if _computes(dtype, target):
        assert not set(INDEXED) & set(outside), outside
        # q's and k's: one kernel each, forward and backward
        assert [len(r.kernels) for r in report.RECORDS] == [2, 2]


@pytest.mark.parametrize("target", TARGETS)
def test_rope_under_autocast(target: str) -> None:
    """A projection under CPU autocast (bf16), then the rotary embedding with cos and
    sin cast to its dtype, as Hugging Face's Llama does."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 16).to(DEVICE)
    cos, sin = _cos_sin(2, 5, 8, torch.float32)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = proj(x).view(2, 5, 2, 8).transpose(1, 2)
        return apply_rotary_pos_emb(q, q * 2.0, cos.to(q.dtype), sin.to(q.dtype))

    x = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    outside = _compare(fn, [x], target, torch.float32, autocast=True)
    assert not set(INDEXED) & set(outside), outside


@pytest.mark.parametrize("target", TARGETS)
def test_cat_of_unequal_pieces_along_any_dim(target: str) -> None:
    torch.manual_seed(0)

    def fn(a, b, c, r, w):
        last = torch.cat([a.sin(), b * 2.0, c.exp()], dim=-1) * w  # 3 + 5 + 1 columns
        middle = torch.cat([a.tanh(), r.neg()], dim=1) + 1.0  # 3 + 2 rows
        return last, middle.relu()

    a, b, c, r = (torch.randn(shape, device=DEVICE, requires_grad=True)
                  for shape in [(4, 3, 3), (4, 3, 5), (4, 3, 1), (4, 2, 3)])
    w = torch.randn(9, device=DEVICE)
    outside = _compare(fn, [a, b, c, r, w], target, torch.float32)
    assert "cat" not in outside, outside


@pytest.mark.parametrize("target", TARGETS)
def test_fuse_indexed_cat_before_a_product(target: str) -> None:
    """A cat that only a library call reads roots its own kernel, with its pieces."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 4, device=DEVICE), torch.randn(2, 4, device=DEVICE)
    w = torch.randn(4, 6, device=DEVICE)
    outside = _compare(lambda a, b, w: torch.cat([a.sin(), b * 2.0], dim=0) @ w,
                       [a, b, w], target, torch.float32)
    assert "cat" not in outside, outside
    assert report.RECORDS[0].rules_fired["fuse-indexed"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_cat_of_reshaped_pieces_reads_them_as_inputs(target: str) -> None:
    """GPT-2's backward cats the q, k and v gradients, each a reshape of attention's:
    the kernel reads a reshape as an input (no point-for-point reading of one), it
    never takes it in (on the GPU the kernel could not be written and the graph
    fell back)."""
    torch.manual_seed(0)
    q, k = torch.randn(6, 8, device=DEVICE), torch.randn(2, 8, 3, device=DEVICE)
    w = torch.randn(16, 5, device=DEVICE)
    outside = _compare(lambda q, k, w: torch.cat(
        [q.view(2, 3, 8), k.transpose(1, 2).reshape(2, 3, 8) * 2.0], dim=2) @ w,
        [q, k, w], target, torch.float32)
    assert "cat" not in outside, outside


@pytest.mark.parametrize("target", TARGETS)
def test_cat_of_transposed_inputs(target: str) -> None:
    """Strided pieces: q projected as [B, T, H, D] and read as [B, H, T, D]."""
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, device=DEVICE).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 5, 3, 8, device=DEVICE).transpose(1, 2).requires_grad_()
    cos, sin = _cos_sin(2, 5, 8, torch.float32)

    def fn(q, k, cos, sin):
        qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
        return qe, torch.cat([qe.transpose(2, 3), ke.transpose(2, 3) * 3.0], dim=2)

    outside = _compare(fn, [q, k, cos, sin], target, torch.float32)
    assert not set(INDEXED) & set(outside), outside


@pytest.mark.parametrize("target", TARGETS)
def test_gradients_of_slices(target: str) -> None:
    """x[..., :k] and x[..., k:] used apart: their gradients, zero-padded, added in
    one kernel; a slice alone; a slice_scatter of a non-zero base (a write into a
    slice of a copy)."""
    torch.manual_seed(0)

    def fn(x, z):
        halves = x[..., :3].sin() * 2.0, x[..., 3:].exp()
        y = x.clone()
        y[:, 1:4] = z.tanh()
        return *halves, x[:, 2:5, 1:6].square(), y * 3.0

    x = torch.randn(4, 6, 7, device=DEVICE, requires_grad=True)
    z = torch.randn(4, 3, 7, device=DEVICE, requires_grad=True)
    outside = _compare(fn, [x, z], target, torch.float32)
    assert not set(INDEXED) & set(outside), outside


@pytest.mark.parametrize("target", TARGETS)
def test_mixed_dtypes_integers_and_symbolic_sizes(target: str) -> None:
    """Pieces of two float dtypes widen exactly, as cat promotes them, and integers
    of one dtype: in the kernel. Integers promoted to floats and symbolic sizes:
    ATen's cat."""
    torch.manual_seed(0)
    a = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    b = torch.randn(2, 4, device=DEVICE, dtype=torch.bfloat16)
    i = torch.arange(12, device=DEVICE).view(3, 4)

    def fn(a, b, i):
        return (torch.cat([a.sin(), b], dim=0) * 2.0, torch.cat([i, i + 1], dim=1) * 3,
                torch.cat([a.cos(), i], dim=1) + 1.0)

    outside = _compare(fn, [a, b, i], target, torch.float32)
    assert outside["cat"] == 1, outside
    outside = _compare(lambda a: torch.cat([a.sin(), a * 2.0], dim=0) + 1.0,
                       [torch.randn(5, 4, device=DEVICE, requires_grad=True)], target,
                       torch.float32, dynamic=True)
    assert outside["cat"] >= 1, outside
