"""The `pointwise` kernel kind: one loop over the output's elements.

Rules fuse-pointwise and fuse-copy name it. Its spec and render are shared with
the row kind (kinds/kernels.py), the template is templates/<target>/pointwise.*.j2.
On Triton, a kernel whose input and output disagree on the innermost dim (NHWC read,
NCHW written) runs as the `pointwise_tiled` variant instead (kinds/pointwise_tiled.py).
"""

from __future__ import annotations

from ..engine.fuse import ROW_REDUCTIONS, FLOATS, broadcasts, kernel_value
from ..engine.term import Term
from .kernels import render_kind, spec_of
from .kind import Kind
from .tuning import PointwiseTuning
from .spec import KernelSpec


class PointwiseSpace:
    """One loop over the output's elements: every member has the root's shape, or
    one that broadcasts to it (a per-channel value, recomputed per element: its
    operands are read through the broadcast, as the kernel's inputs are). A
    float member of the root's shape may be a side output: it is stored where the
    root is, element by element (a broadcast one has no such place, a bool mask
    no float to store: those stay outside when something else reads them)."""

    side_outputs = True

    def __init__(self, root: Term) -> None:
        self.shape = tuple(root.meta.shape)
        self.root = root

    def fits(self, t: Term) -> bool:
        return kernel_value(t, self.root) and broadcasts(tuple(t.meta.shape), self.shape) \
            and t.op not in ROW_REDUCTIONS

    def can_output(self, t: Term) -> bool:
        return t.meta.dtype in FLOATS and tuple(t.meta.shape) == self.shape


def _spec(term: Term, index: int) -> KernelSpec:
    return spec_of(term, index, "pointwise")


def _variant(spec: KernelSpec, target: str) -> str | None:
    # a layout change: 2-d tiles, so that both sides are read and written contiguously
    return "pointwise_tiled" if target == "triton" and spec.meta.get("tile") is not None \
        else None


KIND = Kind(name="pointwise", doc="one loop over the output's elements",
            space=PointwiseSpace, spec=_spec, variant=_variant, render=render_kind,
            launchers={"triton": "TritonLauncher", "openmp": "CppLauncher"},
            tuning=PointwiseTuning())
