"""The `rewritec::iota` op: each element's index along one dim, as an integer.

    iota(shape, dim, start, step, dtype, device)[..., i, ...] = start + step * i

with i the element's index along `dim`; every other dim of `shape` is 1. The
cross entropy's decomposition (frontend/decompositions.py: `_column_hits`) writes
the class positions it compares targets with as one, [1, C] along the columns, so
that a row kernel computes them from its column index (rules/ops.yaml) instead of
reading an `arange` through a view. The eager meaning is that arange, reshaped.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("rewritec", "FRAGMENT")
_LIB.define("iota(SymInt[] shape, int dim, int start, int step, *, ScalarType dtype, "
            "Device device) -> Tensor")


@torch.library.impl(_LIB, "iota", "CompositeExplicitAutograd")
def _iota(shape: list[int], dim: int, start: int, step: int, *, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    n = shape[dim]
    return torch.arange(start, start + step * n, step, dtype=dtype, device=device).reshape(shape)


@torch.library.register_fake("rewritec::iota")
def _iota_fake(shape: list[int], dim: int, start: int, step: int, *, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    torch._check(all(s == 1 for k, s in enumerate(shape) if k != dim),
                 lambda: "iota: every dim but `dim` is 1")
    return torch.empty(shape, dtype=dtype, device=device)


def iota(shape: list[int], dim: int, dtype: torch.dtype, device: torch.device,
         start: int = 0, step: int = 1) -> torch.Tensor:
    return torch.ops.rewritec.iota(shape, dim, start, step, dtype=dtype, device=device)
