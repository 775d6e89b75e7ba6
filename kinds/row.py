"""The `row` kernel kind: pointwise work around reductions along one dim.

Rules fuse-row (softmax, log_softmax, layer_norm, rms_norm) and fuse-row-reduction
name it: one program per row, the row kept in registers. Its spec and render are
shared with the pointwise kind (kinds/kernels.py), the template is
templates/<target>/row.*.j2. On Triton a row too wide for registers runs as the
`row_looped` variant instead (kinds/row_looped.py).
"""

from __future__ import annotations

from typing import Any

from ..engine.fuse import ROW_REDUCTIONS, FLOATS, kernel_value, reduced_dim
from ..engine.term import Term
from .kernels import render_kind, spec_of
from .kind import Kind
from .tuning import RowTuning
from .row_looped import looped
from .spec import KernelSpec


class RowSpace:
    """Rows along one dim `dim` of a shape S: members are S-shaped values or one
    value per row (S with size 1 at `dim`), and reductions run along `dim`.
    Softmax and layer_norm reduce the last dim; a bias gradient reduces dim 0.
    Any float member may be a side output: an S-shaped one is stored with the row's
    elements, a per-row one (layer_norm's mean and rstd) once per row; a bool mask
    is not (the kernel stores floats)."""

    side_outputs = True

    def __init__(self, root: Term) -> None:
        self.dim = reduced_dim(root)
        src = root.args[0] if self.dim is not None else root
        self.shape = tuple(src.meta.shape)
        self.root = root

    def per_row(self) -> tuple[Any, ...] | None:
        if self.dim is None:
            return None
        return self.shape[:self.dim] + (1,) + self.shape[self.dim + 1:]

    def fits(self, t: Term) -> bool:
        if not kernel_value(t, self.root) or not self.shape:
            return False
        if t.op in ROW_REDUCTIONS:
            d = reduced_dim(t)
            if d is None or tuple(t.args[0].meta.shape) != self.shape:
                return False
            if self.dim is None:
                self.dim = d  # the first reduction fixes the group's row dim
            return d == self.dim
        shape = tuple(t.meta.shape)
        if self.dim is None and len(shape) == len(self.shape):
            # A per-row value seen before any reduction fixes the row dim.
            ones = [k for k, (a, b) in enumerate(zip(shape, self.shape, strict=True))
                    if a != b]
            if len(ones) == 1 and shape[ones[0]] == 1:
                self.dim = ones[0]
        return shape in (self.shape, self.per_row())

    def can_output(self, t: Term) -> bool:
        return t.meta.dtype in FLOATS


def _spec(term: Term, index: int) -> KernelSpec:
    spec = spec_of(term, index, "row")
    spec.meta["cols"] = _static(spec)
    return spec


def _static(spec: KernelSpec) -> int:
    """The row length known at compile time (1 when it is symbolic)."""
    try:
        return int(spec.meta["shape"][spec.meta["dim"]])
    except (TypeError, KeyError, IndexError):
        return 1


def _variant(spec: KernelSpec, target: str) -> str | None:
    return "row_looped" if target == "triton" and looped(spec) else None


KIND = Kind(name="row", doc="pointwise work around reductions along one dim, a row per program",
            space=RowSpace, spec=_spec, variant=_variant, render=render_kind,
            launchers={"triton": "RowTritonLauncher", "openmp": "CppLauncher"},
            tuning=RowTuning())
