"""The `rewritec::take` op: values of `x` at positions an index tensor gives.

    take(x, index, dim)[p] = x[p with its coordinate along `dim` replaced by index[p]]

`x` and `index` are aligned from the right, as broadcasting aligns them (`x` may have
fewer dims); along every dim but `dim` either has size 1 or both have the output's
size, and along `dim` the output has the index's size. So an embedding lookup is a
take of the table [V, D] by the ids with a trailing dim of 1 [B, S, 1] along dim -2
(rules/decompose/gathers.yaml): each output element [b, s, d] reads row ids[b, s].

A pointwise kernel computes a take where it holds one (kinds/indexed.py): the index
is loaded at the element, then `x` at the position it names. The eager meaning is
ATen's: `embedding` for that shape, `gather` over broadcast views otherwise, and
an index outside [0, size) raises IndexError as they do.
"""

from __future__ import annotations

import math

import torch

_LIB = torch.library.Library("rewritec", "FRAGMENT")
_LIB.define("take(Tensor x, Tensor index, int dim) -> Tensor")


def take_shape(x_shape: list[int], index_shape: list[int], dim: int) -> list[int]:
    """The output's shape (see the module doc); ValueError where the operands do not
    align."""
    rank = len(index_shape)
    if len(x_shape) > rank:
        raise ValueError(f"take: x has {len(x_shape)} dims, the index {rank}")
    if not -rank <= dim < rank:
        raise ValueError(f"take: dim {dim} is out of range for {rank} dims")
    d = dim % rank
    xs = [1] * (rank - len(x_shape)) + list(x_shape)
    out = []
    for k, (a, b) in enumerate(zip(xs, index_shape, strict=True)):
        if k == d:
            out.append(b)
        elif a == b or a == 1 or b == 1:
            out.append(b if a == 1 else a)
        else:
            raise ValueError(f"take: sizes {a} and {b} along dim {k} do not broadcast")
    return out


def _embedding_form(x: torch.Tensor, index: torch.Tensor, d: int, rank: int) -> bool:
    """x is 1 before `d`, the index is 1 after it: rows of a table by an id each."""
    xs = [1] * (rank - x.dim()) + list(x.shape)
    return all(s == 1 for s in xs[:d]) and all(s == 1 for s in index.shape[d + 1:])


@torch.library.impl(_LIB, "take", "CompositeExplicitAutograd")
def _take(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    rank = index.dim()
    shape = take_shape(list(x.shape), list(index.shape), dim)
    d = dim % rank
    xs = [1] * (rank - x.dim()) + list(x.shape)
    if _embedding_form(x, index, d, rank):
        rows = x.reshape(xs[d], math.prod(xs[d + 1:]))
        return torch.embedding(rows, index.reshape(index.shape[:d + 1])).reshape(shape)
    wide = list(shape)
    wide[d] = xs[d]
    return torch.gather(x.reshape(xs).expand(wide), d, index.long().expand(shape))


@torch.library.register_fake("rewritec::take")
def _take_fake(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    torch._check(not index.dtype.is_floating_point and index.dtype != torch.bool,
                 lambda: f"take: the index is {index.dtype}, not an integer tensor")
    shape = take_shape(list(x.shape), list(index.shape), dim)
    return x.new_empty(shape)


def take(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.rewritec.take(x, index, dim)  # type: ignore[no-any-return]
