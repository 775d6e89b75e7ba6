"""The `rewritec::attention` op: what `rules/recognize/attention.yaml` turns a
written-out attention into, so that one Triton kernel can compute it
(`templates/triton/attention.py.j2`).

    attention(q, kt, v, mask, scale) = softmax(masked_fill(q @ kt * scale, mask, -inf)) @ v

`kt` is the keys already transposed ([..., d, Tk]), as the captured graph
holds them; `mask` (or None) is True where a score is dropped, as
`masked_fill` reads it. The eager meaning below is the captured ops
themselves, in the same order and dtypes, so a graph whose attention no
kernel computes (the CPU, f32) gives eager's results, fully masked rows
(nan) included.

The result is laid out as [B, T, H, d] in memory (a transposed view of that
buffer): heads are merged next with `transpose(1, 2).reshape(B, T, H * d)`,
which is then a view instead of a copy.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("rewritec", "DEF")
_LIB.define("attention(Tensor q, Tensor kt, Tensor v, Tensor? mask, Scalar scale) -> Tensor")


def _empty_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The result buffer: [..., T, d] values with the head dim (-3) innermost but one."""
    shape = torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]) + (q.shape[-2], v.shape[-1])
    if len(shape) != 4:
        return q.new_empty(shape, dtype=q.dtype)
    b, h, t, d = shape
    return q.new_empty((b, t, h, d), dtype=q.dtype).transpose(1, 2)


def attention_eager(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, kt) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = _empty_out(q, v)
    out.copy_(torch.matmul(torch.softmax(scores, dim=-1), v))
    return out


@torch.library.impl(_LIB, "attention", "CompositeExplicitAutograd")
def _attention(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    return attention_eager(q, kt, v, mask, scale)


@torch.library.register_fake("rewritec::attention")
def _attention_fake(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    torch._check(q.shape[-1] == kt.shape[-2], lambda: "attention: q and kt disagree on d")
    torch._check(kt.shape[-1] == v.shape[-2], lambda: "attention: kt and v disagree on Tk")
    return _empty_out(q, v)
