"""What a generated kernel is, as its launcher needs it: `KernelSpec` and its inputs.

Kept apart from the renderers (kinds/kernels.py and the modules beside it) and
free of torch and the rule engine, so that a graph loaded from the graph cache
(runtime/graph_cache.py), which only launches kernels, imports only this,
runtime/launch.py and what they use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.term import Term


# The key of `meta` under which launch.cached_geometry keeps a spec's launch
# geometries: a run-time cache, never stored with the spec (`for_launch`).
GEOMETRY_CACHE = "geometry"


@dataclass
class KInput:
    name: str  # in0, in1, ...
    dtype: str
    flat: bool  # contiguous with the space's shape: offset is the linear index
    per_row: bool  # row kernels: one value per row ([R..., 1])
    rank: int  # the space's rank (strides are passed for every dim)
    shared: bool = False  # row kernels: one row for every row (layer_norm's weight)


@dataclass
class KOutput:
    """One tensor a kernel writes: the root's value (the first), or a side output
    (engine/fuse.py), a member whose value users outside the kernel read too."""

    name: str  # out (the root's), out1, out2, ...
    dtype: str
    per_row: bool  # row kernels: one value per row ([R..., 1]); else the space's shape
    shape: tuple[Any, ...]  # in the graph's dim order


@dataclass
class KernelSpec:
    name: str
    kind: str  # pointwise | row | reduction | matmul | attention
    rule: str
    location: str
    template: str
    inputs: list[KInput]
    body: list[Term]
    root: Term
    # What the kernel writes, the root's value first. One output: the launcher returns
    # that tensor; several (side outputs: pointwise and row kernels): their tuple.
    outputs: list[KOutput]
    rank: int  # rank of the iteration space (row: rank of [R..., C])
    replaced_ops: int
    meta: dict[str, Any] = field(default_factory=dict)
    # The body terms the outputs hold, in their order (dropped with the body).
    written: list[Term] = field(default_factory=list)
    # Set on the copy a launcher keeps for the graph cache (runtime/graph_cache.py),
    # which drops the body: what `compute` found while the body was there.
    compute_dtype: str | None = None
    # Time launch configurations at each new call and keep the fastest (mode
    # max-autotune; runtime/autotune.py). Off: the launchers' heuristics alone.
    autotune: bool = False
    # The name of what autotuning may vary in the launch: the kind's space
    # (kinds/tuning.py), or None
    tuning: str | None = None
    # the `templates/` folder of the user's rule file, searched before the package's
    template_dir: str | None = None

    @property
    def symbol(self) -> str:
        """The kernel's function name in its source: its name less the `k<index>_`
        that numbers it in its graph. Two groups that compute the same thing render
        the same source, so they compile once (the kernel cache and Triton key by
        source) and share one binary, in one graph or across graphs."""
        head, _, rest = self.name.partition("_")
        return rest if rest and head[:1] == "k" and head[1:].isdigit() else self.name

    def symbol_in(self, source: str) -> str:
        """The name `source` defines the kernel by: `symbol` (what the package's kinds
        render), or `name` for a user's kind that renders `name=spec.name`."""
        defined = re.search(rf"\b{re.escape(self.symbol)}\s*\(", source)
        return self.symbol if defined else self.name

    @property
    def template_dirs(self) -> tuple[str, ...]:
        return (self.template_dir,) if self.template_dir else ()

    @property
    def out_dtype(self) -> str:
        """The root's (the first output's) dtype."""
        return self.outputs[0].dtype

    @property
    def per_row_out(self) -> bool:
        """Whether the root's value is one value per row (a row kernel's reduction)."""
        return self.outputs[0].per_row

    @property
    def by_rows(self) -> bool:
        """Whether the kernel iterates over rows along `meta["dim"]` (a row kernel:
        its launch counts rows) rather than over elements (pointwise: elements)."""
        return self.meta.get("dim") is not None

    @property
    def compute(self) -> str:
        """The dtype kernel arithmetic runs in: f64 if anything is f64 or a count
        (a sum of a mask, exact in f64), else f32."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        from ..engine.fuse import counts  # a spec made for launching never gets here

        dtypes = {t.meta.dtype for t in self.body if t.op != "const"}
        return "f64" if "f64" in dtypes or any(counts(t) for t in self.body) else "f32"

    def for_launch(self) -> KernelSpec:
        """This spec without its terms: what launching needs, and all a cache stores.
        Launch geometries cached on the spec (launch.cached_geometry: runtime/ahead.py
        predicts a first launch before the graph is stored) are left to be remade."""
        meta = {k: v for k, v in self.meta.items() if k != GEOMETRY_CACHE}
        return replace(self, body=[], root=None, compute_dtype=self.compute,  # type: ignore[arg-type]
                       meta=meta, written=[])


def broadcast_sizes(shapes: Sequence[Sequence[int]]) -> list[int]:
    """torch.broadcast_shapes of concrete sizes, without it: its first call imports
    torch's symbolic shapes and sympy (half a second of a loaded package's first call)."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != 1:
                if out[i] != 1 and out[i] != n:
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = n
    return out


def block_pow2(n: int) -> int:
    """A power-of-two block of at least n (and 16, tl.dot's least) values."""
    return max(16, 1 << (n - 1).bit_length())


def static_width(spec: KernelSpec) -> int | None:
    """A row kernel's row length when it is static; None when it is symbolic."""
    cols = spec.meta["shape"][spec.meta["dim"]]
    return cols if isinstance(cols, int) else None


def size_params(spec: KernelSpec) -> list[str]:
    """A Triton kernel's `size{k}` parameters: compile-time constants when the shape is
    static, as the graph's shapes are unless TorchDynamo made them symbolic. A strided
    or broadcast input's offset divides the linear index by sizes; by a constant that
    is a shift or a multiply, by a run-time value a 20-odd-instruction division per
    element, which left gelu(x + b) at 8192x4096 on an H100 between 0.094 ms (as fast
    as Inductor, whose sizes are constants too) and 0.184 ms from one process to the
    next. Triton compiles one binary per set of values, as it does per shape anyway."""
    static = all(isinstance(n, int) for n in spec.meta.get("shape") or ())
    return [f"size{k}: tl.constexpr" if static else f"size{k}" for k in range(spec.rank)]


# Columns per chunk of a looped row kernel (kinds/row_looped.py) when the width
# is static: the whole row while it fits STATIC_WHOLE_ROW_C columns (read by 32
# warps, runtime/launch.py: row_warps), else chunks of STATIC_LOOPED_BLOCK_C read by
# 16 (LOOPED_ROW_MAX_WARPS). On an H100 (do_bench, ms; Inductor beside; chunk /
# warps): rows of 32K f32 forward, layer_norm 0.101 (whole/32) against 0.121
# (8K/16) and Inductor's 0.102, rms_norm 0.097 / 0.112 / 0.097, softmax 0.099 /
# 0.112 / 0.122; 2048 x 16K layer_norm 0.097 / 0.115 / 0.098; but 50K-wide rows
# want chunks: softmax of 4096 x 50257 f32 0.96 (8K/16) against 1.68 (32K/32),
# cross entropy of 4096 x 50257 bf16 logits, forward and backward, 2.63 / 3.78.
STATIC_WHOLE_ROW_C = 32768
STATIC_LOOPED_BLOCK_C = 8192
# ... and when it is symbolic, where the loop's trip count is unknown. On an H100
# (1024 rows of 32K f32, run-time width, 32 warps) a layer_norm ran
# 0.157 / 0.145 / 0.125 / 0.131 ms in chunks of 2K / 4K / 8K / 16K.
LOOPED_BLOCK_C = 8192


def chunk(spec: KernelSpec, block: int) -> int:
    """BLOCK_C of a looped kernel whose row fits a power-of-two block of `block`."""
    if static_width(spec) is None:
        return min(block, LOOPED_BLOCK_C)
    return block if block <= STATIC_WHOLE_ROW_C else min(block, STATIC_LOOPED_BLOCK_C)


def stride_params(spec: KernelSpec) -> list[str]:
    """A `reduction` kernel's stride arguments in launch order (kinds/reduction.py):
    per input, the input space's (permuted) strides if the prologue reads it strided,
    then the output's if the epilogue does."""
    params = []
    kept = len(spec.meta["kept"])
    for i, inp in enumerate(spec.inputs):
        phases = spec.meta["phases"][i]
        if "in" in phases and not spec.meta["in_flat"][i]:
            params += [f"{inp.name}_stride{k}" for k in range(spec.rank)]
        if "out" in phases and not spec.meta["out_flat"][i]:
            params += [f"{inp.name}_out_stride{k}" for k in range(kept)]
    return params
