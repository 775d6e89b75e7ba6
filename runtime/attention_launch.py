"""Launching an attention kernel (kinds/attention.py renders it): its tiles, grid
and run-time arguments. Apart from the renderer so that a graph loaded from the
graph cache imports neither it nor the rule engine (runtime/launch.py:
AttentionLauncher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kinds.spec import KernelSpec, block_pow2, broadcast_sizes


@dataclass(frozen=True)
class AttentionTile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_tile(d: int, interpreted: bool) -> AttentionTile:
    """Fixed tiles (no autotuning, so compiling stays fast), those of Triton's own
    fused-attention tutorial for Hopper; the interpreter prefers small blocks."""
    if interpreted:
        return AttentionTile(16, 16, 1, 1)
    if d <= 64:
        return AttentionTile(128, 64, 4, 3)
    return AttentionTile(128, 64, 8, 3)



def attention_launch(spec: KernelSpec, kernel: Any, inputs: tuple[Any, ...]) -> Any:
    meta = spec.meta
    q, kt, v = inputs[meta["q"]], inputs[meta["kt"]], inputs[meta["v"]]
    batch = broadcast_sizes((q.shape[:2], kt.shape[:2], v.shape[:2]))
    b, h = batch
    tq, tk, d, dv = q.shape[2], kt.shape[3], q.shape[3], v.shape[3]
    q, kt, v = (x.expand(b, h, *x.shape[2:]) for x in (q, kt, v))
    if b * h * tq * dv == 0 or tk == 0:
        return None  # nothing to tile (no keys: eager's zeros, not 0 / 0); the caller uses ATen
    out = torch.empty((b, tq, h, dv), dtype=q.dtype, device=q.device).transpose(1, 2)
    read_mask = meta["mask"] is not None and not meta["causal"]
    mask_strides = [0, 0, 0, 0]
    mask = q  # any pointer: not read without HAS_MASK
    if read_mask:
        mask = inputs[meta["mask"]].expand(b, h, tq, tk)
        mask_strides = list(mask.stride())
    tile = choose_tile(d, q.device.type == "cpu")
    grid = (-(-tq // tile.block_m), b * h)
    kernel[grid](q, kt, v, mask, out, h, tq, tk, meta["scale"], *q.stride(), *kt.stride(),
                 *v.stride(), *mask_strides, *out.stride(), D=d, DV=dv, BLOCK_D=block_pow2(d),
                 BLOCK_DV=block_pow2(dv), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                 HAS_MASK=read_mask, IS_CAUSAL=meta["causal"], num_warps=tile.num_warps,
                 num_stages=tile.num_stages)
    return out
