"""Launching a matmul kernel (kinds/matmul.py renders it): its tile and its
run-time arguments. Apart from the renderer so that a graph loaded from the graph
cache imports neither it nor the rule engine (runtime/launch.py: MatmulLauncher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..aten.dtypes import TORCH_DTYPES
from ..kinds.spec import KernelSpec


@dataclass(frozen=True)
class Tile:
    """Block sizes and launch shape of one matmul kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_tile(m: int, n: int, k: int, dtype: str) -> Tile:
    """A fixed heuristic (no autotuning, so compiling stays fast): large tiles for
    half precision on tensor cores, smaller ones for f32 (IEEE products, as eager
    computes them) and for thin matrices."""
    if dtype == "f32" or dtype == "f64":
        return Tile(64, 64, 32, 4, 3)
    if m >= 1024 and n >= 256:
        return Tile(128, 256, 64, 8, 3)
    if m >= 128 and n >= 128:
        return Tile(128, 128, 64, 4, 4)
    return Tile(64, 64, 64, 4, 3)



def matmul_launch_args(spec: KernelSpec, inputs: tuple[Any, ...]) -> tuple[list[Any], Any, Tile]:
    """Kernel arguments (after the input pointers and `out`), the output and the tile."""
    meta = spec.meta
    a, b = inputs[meta["a"]], inputs[meta["b"]]
    m, k = a.shape
    n = b.shape[1]
    shape = meta["shape"]
    out = torch.empty(shape, dtype=TORCH_DTYPES[spec.out_dtype], device=a.device)
    args: list[Any] = [m, n, k, *shape, a.stride(0), a.stride(1), b.stride(0), b.stride(1)]
    if meta["bias"] is not None:
        args += list(inputs[meta["bias"]].expand(m, n).stride())
    else:
        args += [0, 0]
    for i in meta["epilogue"]:
        if not spec.inputs[i].flat:
            args += list(inputs[i].expand(shape).stride())
    return args, out, choose_tile(m, n, k, meta["dtype"])
