"""Attention masks laid out so that torch's fused attention can take them.

`F.scaled_dot_product_attention` picks its kernel while AOTAutograd traces:
cuDNN, flash or memory-efficient attention where the inputs allow, else the
"math" path, which AOTAutograd then writes out as ATen ops (two batched products
in fp32, a `_safe_softmax` over the full T x T scores, and their backward).
The fused kernels take a mask only when its last dim is contiguous. A mask built
by broadcasting (Hugging Face's BERT-style encoders under torch.compile build the
padding mask by expanding a per-position vector: strides (0, T, 1, 0)) is not,
and sent every attention of the model down the math path: a BERT-base training
step on an H100 took 22.5 ms of GPU time with it, 12.9 with fused attention
(eager: 14.7), and Inductor, which gets the same graph, pays it too.

`contiguous_attention_masks` rewrites TorchDynamo's graph (or an exported
program's, frontend/export.py) before AOTAutograd traces it: such a mask is copied
contiguous first (B x H x T x T booleans or values, small beside the scores the math
path writes), and the choice falls to a fused kernel. The results are the math
path's: the copy holds the same values, and a query row with every key masked out is
zeroed as `_safe_softmax` zeroes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

# Devices whose fused attention refuses such masks (on the CPU, torch's flash
# attention takes them as they are)
FUSED_MASK_DEVICES = ("cuda",)


def _attention_mask(node: torch.fx.Node) -> tuple[str | int, torch.fx.Node] | None:
    """Where an `F.scaled_dot_product_attention` call takes its mask (a kwarg name or
    a position), when the mask is a graph value."""
    name = getattr(node.target, "__name__", "")  # F's, or ATen's (an exported graph)
    if node.op != "call_function" or name not in ("scaled_dot_product_attention",
                                                  "scaled_dot_product_attention.default"):
        return None
    mask = node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        return "attn_mask", mask
    if len(node.args) > 3 and isinstance(node.args[3], torch.fx.Node):
        return 3, node.args[3]
    return None


def _copied_value(mask: torch.fx.Node) -> torch.Tensor | None:
    """The mask's traced value when it is to be copied: on a device of
    FUSED_MASK_DEVICES, its last dim neither contiguous nor of size 1."""
    value: Any = mask.meta.get("example_value", mask.meta.get("val"))
    if (not isinstance(value, torch.Tensor) or value.dim() == 0
            or value.device.type not in FUSED_MASK_DEVICES):
        return None
    # a symbolic size or stride (a dynamic export) counts only where known
    if statically_known_true(value.shape[-1] > 1) and statically_known_true(
            value.stride(-1) != 1):
        return value
    return None


def contiguous_attention_masks(gm: torch.fx.GraphModule) -> int:
    """Copy contiguous each attention mask whose last dim is not (see the module
    docstring), in place; how many were copied.

    Where the math path would have run, a query whose keys are all masked out gets
    zeros (its `_safe_softmax`), while the fused kernels give it other values; so
    each rewritten call zeroes those rows itself: `where(any(mask over keys), out,
    0)` (a bool mask; for an additive one, any key above -inf), which is also the
    math path's gradient (none flows from such a row)."""
    copied = 0
    graph = gm.graph
    for node in list(graph.nodes):
        found = _attention_mask(node)
        value = None if found is None else _copied_value(found[1])
        if found is None or value is None:
            continue
        where, mask = found
        with graph.inserting_before(node):
            dense = graph.call_method("contiguous", (mask,))
            attends = (dense if value.dtype == torch.bool
                       else graph.call_function(torch.ne, (dense, float("-inf"))))
            alive = graph.call_method("any", (attends, -1), {"keepdim": True})
        if isinstance(where, str):
            node.kwargs = {**node.kwargs, where: dense}
        else:
            node.args = (*node.args[:where], dense, *node.args[where + 1:])
        users = list(node.users)
        with graph.inserting_after(node):
            out = graph.call_function(torch.where, (alive, node, 0.0))
        for user in users:
            user.replace_input_with(node, out)
        copied += 1
    if copied:
        graph.lint()
        gm.recompile()
    return copied
