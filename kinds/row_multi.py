"""The multi-row Triton row kernel, for narrow rows: ROWS rows a program.

The `row` template runs one program per row. A row of a few dozen values (a
windowed attention's softmax over 49 keys, a layer norm over 96 channels) then
leaves most lanes of a program idle and launches one program per row, hundreds of
thousands of them. This variant lays ROWS rows out as a [ROWS, BLOCK_C] block:
element values are 2-d, a reduction along the row keeps its axis ([ROWS, 1]) and
per-row loads and stores are masked past the last row. It is chosen for static
widths up to MULTI_ROW_MAX_COLS (kinds/row.py: narrow); the launcher picks ROWS
(runtime/launch.py: MultiRowTritonLauncher).
"""

from __future__ import annotations

from ..engine.ops import OpTable
from .kind import Kind
from .row import TritonRows, render_triton
from .spec import KernelSpec
from .tuning import RowTuning

ROWS_2D = TritonRows(axis=1, row_mask="row_mask")


def n_rows(spec: KernelSpec) -> str:
    """The count of rows, from the space's sizes (the row dim is the last)."""
    return " * ".join(f"size{k}" for k in range(spec.rank - 1)) or "1"


def _render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
            table: OpTable) -> str:
    return render_triton(spec, table, ROWS_2D, n_rows=n_rows(spec))


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES: dict[str, frozenset[str]] = {
    "triton": frozenset({"header", "loads", "n_rows", "name", "params", "stmts", "stores"}),
}


KIND = Kind(name="row_multi", template_variables=TEMPLATE_VARIABLES,
            doc="a row kernel taking several narrow rows a program",
            base="row", render=_render, launchers={"triton": "MultiRowTritonLauncher"},
            tuning=RowTuning())
