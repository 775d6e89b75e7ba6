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
from ..aten.iota import iota
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


# Ops of the op table that a joint forward+backward graph gets written out. The
# backward of log_softmax reads its output; kept whole, the partitioner could only
# save that output (a cross entropy's f32 log-probabilities, 0.8 GB for GPT-2's
# 4096 x 50257 logits) or recompute the whole op. Written out, it saves the row
# maxima and log-sums ([rows, 1]) and the backward's row kernel recomputes
# `x - max - logsum` from the logits it has anyway. The rules fuse the pieces into
# the same row kernel as they fuse the op's own decomposition.
SPLIT_FOR_TRAINING = (torch.ops.aten._log_softmax.default,)


@cache
def decomposition_table(keep: tuple[str, ...] = (), training: bool = False) -> dict[Any, Any]:
    """AOTAutograd's decompositions, less the ops of the op table and the ATen
    overloads `keep` (kept_whole); `training`: for joint graphs, which keep
    SPLIT_FOR_TRAINING decomposed."""
    table = _core_aten()  # the op table comes parsed with the rules: no YAML read
    every = torch._decomp.decomposition_table  # SPLIT_FOR_TRAINING are core ATen ops
    split = {op: every[op] for op in SPLIT_FOR_TRAINING if training and op in every}
    for name in (*builtin_op_table().by_aten, *keep):
        op = overload(name)
        table.pop(op, None)
        table.pop(op.overloadpacket, None)
    table.update(split)
    # Keep whole the backward ops the rules and kernels treat as one step, and
    # embedding's: its decomposition is an accumulating index_put, which ATen runs
    # one index at a time per destination row, so an embedding of few rows read
    # many times (T5's relative position buckets) took longer than the rest of the
    # training step; ATen's own backward sorts the indices and sums by segment.
    # (layer_norm's, softmax's and batch_norm's backward are op-table ops: popped
    # above, so core ATen's decomposition, ten-odd calls per batch norm, never runs,
    # and rules/decompose/norms.yaml writes them out as reductions the fuse rules
    # join with the pointwise work around them.)
    for whole in (torch.ops.aten.convolution_backward.default,
                  torch.ops.aten.embedding_dense_backward.default):
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
    # A class-index loss picks one column of each row through a comparison with
    # the column positions, which a row kernel computes where it reads the row
    table[torch.ops.aten.nll_loss_forward.default] = _nll_loss_forward
    table[torch.ops.aten.nll_loss_backward.default] = _nll_loss_backward
    # an op-table op (rules write it out), but for the statistics' dtype on mixed
    # inputs, where ATen runs it (the rules' half forms cast them anyway)
    table[torch.ops.aten.native_layer_norm_backward.default] = _layer_norm_backward
    return table


def _layer_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, normalized_shape: Any,
                         mean: torch.Tensor, rstd: torch.Tensor, weight: Any, bias: Any,
                         output_mask: Any) -> Any:
    """ATen's layer_norm backward, with the mean and rstd in f32 where the input is
    half and the weight f32 (CPU autocast leaves a bf16 GELU output into an f32
    LayerNorm). Eager's forward returns them in f32 then and the backward requires
    them so, but the traced graph (FakeTensor's dtypes) has them in the input's dtype,
    so a compiled forward saves them in bf16 and the backward refused them. Anything
    else is the op itself (NotImplemented: the tracer records it unchanged)."""
    mixed = input.dtype in (torch.float16, torch.bfloat16) and isinstance(
        weight, torch.Tensor) and weight.dtype == torch.float32
    if not mixed or (mean.dtype == torch.float32 and rstd.dtype == torch.float32):
        return NotImplemented
    return torch.ops.aten.native_layer_norm_backward.default(
        grad_out, input, normalized_shape, mean.float(), rstd.float(), weight, bias,
        output_mask)


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.aten.mean.dim(x, [], False, dtype=dtype)


# --------------------------------------------------------------------- nll_loss
# Core ATen writes the loss of a [N, C] input with [N] class indices as a gather of
# the target column (forward) and a scatter of -1 into a zeros_like tensor
# (backward). Both are library calls: the forward must write the log-probabilities
# out for the gather, and the backward writes a [N, C] zero tensor and reads it
# back. GPT-2's loss over 4096 x 50257 logits spent 1.9 ms of an H100 step there.
# Written as comparisons of the column positions with the targets, the pick is a
# row reduction (forward) and a mask (backward) that join the log-softmax's row
# kernels: the same values, as the scatter writes -1 and the gather reads one value.
# Weighted losses and other ranks keep torch's decomposition.
_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _one_hot_plain(self: torch.Tensor, target: torch.Tensor, weight: Any) -> bool:
    return weight is None and self.dim() == 2 and target.dim() == 1


def _column_hits(self: torch.Tensor, safe_target: torch.Tensor) -> torch.Tensor:
    """[N, C] bool: column c of row n is row n's target."""
    # positions a row kernel computes from its column index (aten/iota.py)
    columns = iota([1, self.shape[1]], 1, safe_target.dtype, self.device)
    return columns == safe_target.unsqueeze(1)


def _nll_loss_forward(self: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not _one_hot_plain(self, target, weight):
        return torch._decomp.decomposition_table[torch.ops.aten.nll_loss_forward.default](
            self, target, weight, reduction, ignore_index)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    # kept as a column, so the pick is a row kernel's reduction (kinds/row.py:
    # RowSpace holds per-row values as [N, 1])
    picked = torch.where(_column_hits(self, safe_target), self, 0).sum(1, keepdim=True)
    picked = picked.squeeze(1)
    result = torch.where(valid, -picked, 0)
    if reduction == _REDUCTION_NONE:
        return result, self.new_full((), 0.0)
    total_weight = valid.sum().to(self)
    if reduction == _REDUCTION_SUM:
        return result.sum(), total_weight
    return result.sum() / total_weight, total_weight


def _nll_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                       weight: Any, reduction: int, ignore_index: int,
                       total_weight: torch.Tensor) -> torch.Tensor:
    if not _one_hot_plain(self, target, weight):
        return torch._decomp.decomposition_table[torch.ops.aten.nll_loss_backward.default](
            grad_output, self, target, weight, reduction, ignore_index, total_weight)
    if reduction == _REDUCTION_MEAN:
        grad_output = grad_output / total_weight
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    if grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(1)
    grad_output = torch.where(valid.unsqueeze(1), grad_output, 0)
    # -grad at the target, 0 elsewhere, as ATen's scatter into zeros: an inf or nan
    # gradient stays at the target (-1 * grad would spread it over the row as 0 * nan)
    return torch.where(_column_hits(self, safe_target), -grad_output, 0).to(self.dtype)
