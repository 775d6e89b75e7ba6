"""The `pointwise_tiled` kernel kind: a pointwise kernel run in 2-d tiles.

A variant of `pointwise` (kinds/pointwise.py) that no rule names: chosen on Triton
when an input's innermost dim is not the output's (a layout change, NHWC read and
NCHW written), so that both sides stay contiguous. Triton only; Python writes each
input's and the output's tile offsets, templates/triton/pointwise_tiled.py.j2 the
tile loop.
"""

from __future__ import annotations

import sympy

from ..engine.ops import OpTable
from .kernels import check_template, print_index, subspace_offset, triton_load
from .kind import Kind
from .pointwise import render_elementwise_triton
from .spec import KernelSpec
from .tuning import TiledTuning


def _tiled_offsets(spec: KernelSpec) -> tuple[dict[str, str], str]:
    """Offsets for the tiled pointwise template: per input, and the output's."""
    rank, y, x = spec.rank, spec.meta["tile"], spec.rank - 1
    sizes = [sympy.Symbol(f"size{k}", integer=True, positive=True) for k in range(rank)]
    dense = [sympy.Mul(*sizes[k + 1:]) for k in range(rank)]
    zdims = [k for k in range(rank) if k not in (y, x)]

    def offset(strides: list[sympy.Expr]) -> str:
        z = print_index(subspace_offset(zdims, sizes, strides, "z"), "triton") if zdims else "0"
        return (f"{z} + offs_y[:, None] * ({print_index(strides[y], 'triton')}) "
                f"+ offs_x[None, :] * ({print_index(strides[x], 'triton')})")

    out = offset(dense)
    offsets = {}
    for inp in spec.inputs:
        strides = dense if inp.flat else [sympy.Symbol(f"{inp.name}_stride{k}", integer=True)
                                          for k in range(rank)]
        offsets[inp.name] = offset(strides)
    return offsets, out


def render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
           table: OpTable) -> str:
    check_template(spec, target)
    offsets, out_offset = _tiled_offsets(spec)
    loads = [triton_load(spec, k, offsets[inp.name], "mask")
             for k, inp in enumerate(spec.inputs)]
    # every output at the template's out_offset
    return render_elementwise_triton(spec, table, loads, out_offset=out_offset,
                                     tile_y=spec.meta["tile"], tile_x=spec.rank - 1)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"header", "loads", "name", "out_offset", "params", "stmts",
                         "stores", "tile_x", "tile_y"}),
}


KIND = Kind(name="pointwise_tiled", template_variables=TEMPLATE_VARIABLES,
            doc="a pointwise kernel in 2-d tiles (a layout change)",
            base="pointwise", render=render, launchers={"triton": "TiledTritonLauncher"},
            tuning=TiledTuning())
