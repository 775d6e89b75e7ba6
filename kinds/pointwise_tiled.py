"""The `pointwise_tiled` kernel kind: a pointwise kernel run in 2-d tiles.

A variant of `pointwise` (kinds/pointwise.py) that no rule names: chosen on Triton
when an input's innermost dim is not the output's (a layout change, NHWC read and
NCHW written), so that both sides stay contiguous. Triton only; its offsets come
from kinds/kernels.py (`_tiled_offsets`), its template is
templates/triton/pointwise_tiled.py.j2.
"""

from __future__ import annotations

from .kernels import render_kind
from .kind import Kind
from .tuning import TiledTuning


KIND = Kind(name="pointwise_tiled", doc="a pointwise kernel in 2-d tiles (a layout change)",
            base="pointwise", render=render_kind, launchers={"triton": "TiledTritonLauncher"},
            tuning=TiledTuning())
