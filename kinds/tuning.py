"""What autotuning may vary in each kind's Triton launch: its `TuneSpace`.

Under mode max-autotune runtime/autotune.py times a kernel's launch
configurations and keeps the fastest; the configurations, and the grid each
launches on, are the kernel's kind's (`Kind.tuning`). A kind without one
(attention) is not tuned.

runtime/prepare.py writes the space's name into the spec (`KernelSpec.tuning`):
specs are stored as plain data (the graph cache, packages), and a launcher built
from a stored spec finds its space here by that name (`space`). The spaces live
here, apart from the kinds' modules, so that such a launcher imports nothing
heavier than kinds/spec.py does (no sympy, no rule engine; tests/test_graph_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .spec import KernelSpec

# A configuration: the constexprs and launch options it changes in the heuristic's
# launch. {} is the heuristic's own.
Config = dict[str, int]

DEFAULT_WARPS = 4  # Triton's num_warps when a launch gives none


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def warps_around(heuristic: int) -> list[int]:
    """Powers of two from 1 to 32 within 4x of the heuristic's warps."""
    return [w for w in (1, 2, 4, 8, 16, 32) if heuristic <= 4 * w and w <= 4 * heuristic]


@dataclass(frozen=True)
class TuneSpace:
    """The configurations a kind's launch tries, given the heuristic's kwargs, and
    the grid each launches on, from the heuristic's launch (its positional
    arguments and grid). This base changes no block size: the heuristic's grid."""

    name: ClassVar[str] = "?"  # for logs and tests

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        raise NotImplementedError

    def grid(self, spec: KernelSpec, config: Config, args: tuple[Any, ...],
             grid: tuple[int, ...]) -> tuple[int, ...]:
        return grid


@dataclass(frozen=True)
class PointwiseTuning(TuneSpace):
    name: ClassVar[str] = "pointwise"

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        return [{"BLOCK_SIZE": b, "num_warps": w} for b in (256, 512, 1024, 2048, 4096)
                for w in (2, 4, 8)]

    def grid(self, spec: KernelSpec, config: Config, args: tuple[Any, ...],
             grid: tuple[int, ...]) -> tuple[int, ...]:
        # runtime/launch.py: TritonLauncher, args (*inputs, *outputs, n, *space, *strides)
        n = args[len(spec.inputs) + len(spec.outputs)]
        return (cdiv(n, config["BLOCK_SIZE"]),)


@dataclass(frozen=True)
class TiledTuning(TuneSpace):
    name: ClassVar[str] = "pointwise_tiled"
    tiles: ClassVar[tuple[tuple[int, int], ...]] = (
        (32, 32), (32, 64), (64, 32), (64, 64), (32, 128), (128, 32), (64, 128), (128, 64))

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        return [{"BLOCK_Y": y, "BLOCK_X": x, "num_warps": w} for y, x in self.tiles
                for w in (4, 8)]

    def grid(self, spec: KernelSpec, config: Config, args: tuple[Any, ...],
             grid: tuple[int, ...]) -> tuple[int, ...]:
        # args (*inputs, *outputs, numel, *space, *strides); tiles over space dims
        # `tile` and the last
        first = len(spec.inputs) + len(spec.outputs) + 1
        numel, space = args[first - 1], args[first:first + spec.rank]
        tile = int(spec.meta["tile"])
        tiles = cdiv(space[tile], config["BLOCK_Y"]) * cdiv(space[-1], config["BLOCK_X"])
        return (numel // (space[tile] * space[-1]) * tiles,)


@dataclass(frozen=True)
class RowTuning(TuneSpace):
    """num_warps within 4x of the heuristic's."""

    name: ClassVar[str] = "row"

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        return [{"num_warps": w}
                for w in warps_around(int(kwargs.get("num_warps", DEFAULT_WARPS)))]


@dataclass(frozen=True)
class LoopedRowTuning(RowTuning):
    """The row's warps, and num_stages: a loop over chunks, whose loads pipelining
    may pay."""

    name: ClassVar[str] = "row_looped"

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        return [{**c, "num_stages": s} for c in super().configs(spec, kwargs)
                for s in (1, 2, 3)]


@dataclass(frozen=True)
class ReductionTuning(TuneSpace):
    """The main kernel's warps only: its block sizes set the split (the combine
    kernel is not tuned)."""

    name: ClassVar[str] = "reduction"

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        return [{"num_warps": w} for w in (2, 4, 8, 16)]


# (block_m, block_n, block_k, num_warps, num_stages): f32 and f64 products run in
# IEEE precision on CUDA cores, so small tiles; half precision on tensor cores.
WIDE_TILES = ((64, 64, 32, 4, 3), (32, 32, 32, 4, 2), (32, 64, 32, 4, 3), (64, 32, 32, 4, 3),
              (64, 64, 16, 4, 4), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3),
              (64, 64, 32, 8, 3), (128, 128, 32, 8, 3), (32, 32, 64, 2, 3))
HALF_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 64, 64, 4, 3),
              (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
              (64, 256, 32, 4, 4), (256, 128, 32, 8, 3), (64, 64, 32, 2, 5),
              (32, 64, 32, 4, 5), (256, 64, 64, 8, 4))


@dataclass(frozen=True)
class MatmulTuning(TuneSpace):
    """About ten tiles for the dtype (block m/n/k, warps, stages)."""

    name: ClassVar[str] = "matmul"

    def configs(self, spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
        tiles = WIDE_TILES if spec.meta.get("dtype") in ("f32", "f64") else HALF_TILES
        return [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": w,
                 "num_stages": s} for m, n, k, w, s in tiles]

    def grid(self, spec: KernelSpec, config: Config, args: tuple[Any, ...],
             grid: tuple[int, ...]) -> tuple[int, ...]:
        # runtime/launch.py: MatmulLauncher, args (*inputs, out, M, N, K, ...)
        m, n = args[len(spec.inputs) + 1], args[len(spec.inputs) + 2]
        return (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)


# Every space, by the name a spec carries
SPACES: dict[str, TuneSpace] = {s.name: s for s in (
    PointwiseTuning(), TiledTuning(), RowTuning(), LoopedRowTuning(), ReductionTuning(),
    MatmulTuning())}


def space(name: str | None) -> TuneSpace | None:
    """The space named `name` (a spec's `tuning`); None: not tuned."""
    return None if name is None else SPACES[name]
