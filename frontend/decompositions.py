"""Which ATen ops AOTAutograd decomposes before rewritec sees the graph.

Core-ATen decompositions turn composite ops into ops the rules and kernels
know (e.g. `silu_backward` into pointwise ops). Ops listed in the op table
are kept whole: rewritec's own YAML rules decide how to decompose them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch._decomp import core_aten_decompositions

from ..engine.ops import default_op_table
from .aten import overload


@cache
def decomposition_table() -> dict[Any, Any]:
    table = dict(core_aten_decompositions())
    for name in default_op_table().by_aten:
        op = overload(name)
        table.pop(op, None)
        table.pop(op.overloadpacket, None)
    # Keep whole the backward ops the rules and kernels treat as one step.
    for keep in (torch.ops.aten.native_layer_norm_backward.default,
                 torch.ops.aten._softmax_backward_data.default,
                 torch.ops.aten.convolution_backward.default):
        table.pop(keep, None)
    # Core ATen turns sum.default into sum.dim_IntList over every dim, but not
    # mean.default: do the same, so `x.mean()` is the op table's `mean`.
    table[torch.ops.aten.mean.default] = _mean_all
    return table


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.aten.mean.dim(x, [], False, dtype=dtype)
