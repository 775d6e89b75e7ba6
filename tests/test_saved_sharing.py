"""A training forward graph's saved tensors are not copied to keep them apart.

Under autocast eager casts a normalized activation once per linear layer that reads
it (q, k and v: three saved bf16 tensors of one value), and a causal mask the graph
folds to a constant is saved once per attention layer. Hash-consing makes each one
term; only the backward reads them, so the forward graph saves that one tensor at
every position (compiler.py: `_outputs_to_clone`) instead of copying it. What the
caller receives is still copied where eager gave distinct tensors (the last test).
Graphs replayed as CUDA graphs (cudagraphs="on") share them too: a shared folded
constant is not the recording's memory (tests/test_cudagraphs.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from models import check_block_under_autocast


class Attention(nn.Module):
    """Two attention layers over one causal mask, each normed input read by q, k, v."""

    def __init__(self, width: int = 32, heads: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(2))
        self.qkv = nn.ModuleList(nn.ModuleList(nn.Linear(width, width) for _ in range(3))
                                 for _ in range(2))
        self.seq = seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        for norm, (q, k, v) in zip(self.norms, self.qkv, strict=True):
            h = norm(x)
            split = [t(h).view(b, s, self.heads, w // self.heads).transpose(1, 2)
                     for t in (q, k, v)]
            a = F.scaled_dot_product_attention(*split, attn_mask=mask)
            x = x + a.transpose(1, 2).reshape(b, s, w)
        return x


def _copies_in_forward(model: nn.Module, x: torch.Tensor) -> int:
    """The copies the compiled graphs' wrappers make in a training step (an ATen
    clone or copy_ they call themselves, not one inside another ATen op)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
    return sum(1 for e in prof.events() if e.name in ("aten::clone", "aten::copy_")
               and e.cpu_parent is not None and e.cpu_parent.name.startswith("Compiled"))


@pytest.mark.parametrize("shape", [(2, 8, 32), (3, 5, 32)])
def test_shared_saved_tensors_keep_gradients(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    check_block_under_autocast(lambda: Attention(seq=shape[1]), x)


@pytest.mark.parametrize("cudagraphs", ["auto", "on"])
def test_shared_saved_tensors_are_not_copied(cudagraphs: str) -> None:
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rewritec",
                             options={"strict": True, "cudagraphs": cudagraphs})
    _copies_in_forward(compiled, x)  # compiles
    model.zero_grad(set_to_none=True)
    # 6 before: the inputs of k and v in both layers, and the masks
    assert _copies_in_forward(compiled, x) == 0


def test_returned_tensors_stay_apart() -> None:
    # two equal results the caller receives: distinct tensors, as eager gives
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin() * 2, x.sin() * 2

    x = torch.randn(4, 4, requires_grad=True)
    torch._dynamo.reset()
    a, b = torch.compile(fn, backend="rewritec", options={"strict": True})(x)
    assert a.data_ptr() != b.data_ptr()
    a.add_(1)
    torch.testing.assert_close(b, x.detach().sin() * 2)
