"""Which ATen ops AOTAutograd decomposes before rewritec sees the graph.

Core-ATen decompositions turn composite ops into ops the rules and kernels
know (e.g. `silu_backward` into pointwise ops). Ops listed in the op table
are kept whole: rewritec's own YAML rules decide how to decompose them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch._decomp
from torch._decomp import core_aten_decompositions

from ..aten.bridge import overload
from ..engine.errors import RewritecError
from ..options import Options
from ..rulesets import builtin_op_table, op_table_for

# Outside core ATen's post-autograd list but in export's default table, which
# adds them beside the CompositeImplicitAutograd ops (those decompose while
# AOTAutograd traces, table or not).
_EXPORT_EXTRAS = ("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
                  "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d")


def _core_aten() -> dict[Any, Any]:
    """Core ATen's decompositions. Export's default table (`core_aten_decompositions`)
    also lists every CompositeImplicitAutograd op, and building it takes 0.15-0.2 s
    in each process (a warm compile's largest piece after Triton's start-up);
    the post-autograd list plus the extras above is the same table for tracing."""
    post = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    if post is None:  # another torch: the public table
        return dict(core_aten_decompositions())
    table = dict(post())
    for name in _EXPORT_EXTRAS:
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op in torch._decomp.decomposition_table:
            table[op] = torch._decomp.decomposition_table[op]
    return table


def kept_whole(opts: Options) -> tuple[str, ...]:
    """The ATen overloads of the ops the user's rule files declare (rulesets.py:
    op_table_for): kept whole, as the package's are, so a user's `softplus` op sees
    softplus and not its decomposition."""
    if not opts.rules:
        return ()
    try:
        table = op_table_for(opts)
    except RewritecError:
        return ()  # the broken file is reported when the graph compiles
    return tuple(sorted(set(table.by_aten) - set(builtin_op_table().by_aten)))


@cache
def decomposition_table(keep: tuple[str, ...] = ()) -> dict[Any, Any]:
    """AOTAutograd's decompositions, less the ops of the op table and the ATen
    overloads `keep` (kept_whole)."""
    table = _core_aten()  # the op table comes parsed with the rules: no YAML read
    for name in (*builtin_op_table().by_aten, *keep):
        op = overload(name)
        table.pop(op, None)
        table.pop(op.overloadpacket, None)
    # Keep whole the backward ops the rules and kernels treat as one step, and
    # embedding's: its decomposition is an accumulating index_put, which ATen runs
    # one index at a time per destination row, so an embedding of few rows read
    # many times (T5's relative position buckets) took longer than the rest of the
    # training step; ATen's own backward sorts the indices and sums by segment.
    # batch_norm's backward likewise: core ATen's decomposition is ten-odd calls per
    # batch norm (per-channel sums, [C]-vector products, three broadcasts), and the
    # fuse rules cannot yet join its reductions with the pointwise work they share,
    # so each was a launch; on an H100, ResNet-50's training step went from 1296
    # launches and 31.2 ms to 910 and 24.8 ms kept whole (MobileNetV3 38.7 -> 27.0).
    for whole in (torch.ops.aten.native_layer_norm_backward.default,
                  torch.ops.aten._softmax_backward_data.default,
                  torch.ops.aten.convolution_backward.default,
                  torch.ops.aten.embedding_dense_backward.default,
                  torch.ops.aten.native_batch_norm_backward.default):
        table.pop(whole, None)
    # Core ATen rewrites the CPU flash-attention op into the math attention, whose
    # second output is the attention weights; the op's backward reads that output as
    # the logsumexp, so gradients came out wrong, and under autocast its dtype broke
    # the backward. Kept whole, as Inductor keeps it: ATen's own forward and backward.
    sdpa_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if sdpa_cpu is not None:
        table.pop(sdpa_cpu.default, None)
    # Core ATen turns sum.default into sum.dim_IntList over every dim, but not
    # mean.default: do the same, so `x.mean()` is the op table's `mean`.
    table[torch.ops.aten.mean.default] = _mean_all
    return table


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.aten.mean.dim(x, [], False, dtype=dtype)
