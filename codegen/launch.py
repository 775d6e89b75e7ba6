"""Turning the `kernel` terms of a graph into callable launchers.

For each kernel term: build its `KernelSpec`, render it for the target, build
it through the cache and wrap it in a launcher that allocates the output,
computes sizes, strides and the grid at run time, and launches. A kernel that
fails to render or build is replaced by its body again, so that group runs
through ATen, with a warning naming the rule and template (`strict` raises).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine.term import Graph, Term, TermStore, rebuild
from ..frontend.aten import TORCH_DTYPES, Bridge
from . import row_looped, static_launch
from .attention import attention_launch, attention_spec, render_attention
from .build import BuildError, build_cpp, load_triton, triton_module
from .kernels import KernelSpec, RenderError, block_pow2, render, spec_of
from .matmul import matmul_launch_args
from .reduction import reduction_spec, render_reduction
from .row_looped import looped, render_row_looped
from .triton_direct import DirectKernel


class KernelFallback(UserWarning):
    """A fused group runs through ATen because its kernel could not be built."""


class Launcher:
    """Runs one kernel; if a launch fails (out of memory, a driver error), warns once
    and runs the group's ATen body instead, so the result is still correct."""

    spec: KernelSpec
    fallback: Callable[..., torch.Tensor]
    failed: bool = False
    strict: bool = False
    recipe: KernelRecipe | None = None

    def __init__(self, spec: KernelSpec, kernel: Any,
                 fallback: Callable[..., torch.Tensor]) -> None:
        self.spec = spec
        self.kernel = kernel
        self.fallback = fallback

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            try:
                return self.launch(*inputs)
            except Exception as e:
                if self.strict:
                    raise
                self.failed = True
                warnings.warn(f"rewritec: kernel {self.spec.name} (rule {self.spec.rule}) "
                              f"failed at launch and falls back to ATen: "
                              f"{type(e).__name__}: {e}", KernelFallback, stacklevel=2)
        return self.fallback(*inputs)

    def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CppLauncher(Launcher):
    def __init__(self, spec: KernelSpec, fn: Any, fallback: Callable[..., torch.Tensor]) -> None:
        self.spec = spec
        self.fn = fn
        self.fallback = fallback
        n_ptr = len(spec.inputs) + 1
        n_int = spec.rank + sum(spec.rank for i in spec.inputs if not i.flat) + 2
        fn.argtypes = [ctypes.c_void_p] * n_ptr + [ctypes.c_int64] * n_int
        fn.restype = None
        self.out_dtype = TORCH_DTYPES[spec.out_dtype]

    def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
        space, out, tensors, strides = _prepare(self.spec, inputs, self.out_dtype)
        if out.numel() == 0:
            return out
        cols = space[-1] if space else 1
        count = out.numel() if self.spec.kind == "pointwise" else (
            _numel(space) // cols if cols else 0)
        self.fn(*[t.data_ptr() for t in tensors], out.data_ptr(), *space, *strides, count, cols)
        return out


class TritonLauncher(Launcher):
    BLOCK_SIZE = 1024
    TILE_Y = 64  # tiled pointwise kernels (layout changes): 64 x 64 values a program
    TILE_X = 64

    def __init__(self, spec: KernelSpec, kernel: Any,
                 fallback: Callable[..., torch.Tensor]) -> None:
        super().__init__(spec, kernel, fallback)
        self.out_dtype = TORCH_DTYPES[spec.out_dtype]

    def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
        space, out, tensors, strides = _prepare(self.spec, inputs, self.out_dtype)
        if out.numel() == 0:
            return out
        tile = self.spec.meta.get("tile")
        if self.spec.template == "pointwise_tiled":
            # codegen/kernels.py: _tiled_offsets; tiles over space dims `tile` and the last
            tiles = triton_cdiv(space[tile], self.TILE_Y) * triton_cdiv(space[-1], self.TILE_X)
            grid = (out.numel() // (space[tile] * space[-1]) * tiles,)
            self.kernel[grid](*tensors, out, out.numel(), *space, *strides,
                              BLOCK_Y=self.TILE_Y, BLOCK_X=self.TILE_X)
        elif self.spec.kind == "pointwise":
            n = out.numel()
            grid = (triton_cdiv(n, self.BLOCK_SIZE),)
            self.kernel[grid](*tensors, out, n, *space, *strides, BLOCK_SIZE=self.BLOCK_SIZE)
        else:
            cols = space[-1]
            rows = _numel(space) // cols
            block = block_pow2(cols)
            if self.spec.template == "row_looped":  # codegen/row_looped.py: chunks of a row
                block = row_looped.chunk(self.spec, block)
            self.kernel[(rows,)](*tensors, out, cols, *space, *strides, BLOCK_C=block,
                                 num_warps=row_warps(block))
        return out


class MatmulLauncher(Launcher):
    """A matrix product with its epilogue (codegen/matmul.py); Triton only."""

    def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
        args, out, tile = matmul_launch_args(self.spec, inputs)
        m, n = args[0], args[1]
        if out.numel() == 0 or args[2] == 0:
            return self.fallback(*inputs)  # empty products: nothing to tile
        grid = (triton_cdiv(m, tile.block_m) * triton_cdiv(n, tile.block_n),)
        self.kernel[grid](*inputs, out, *args, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                          num_warps=tile.num_warps, num_stages=tile.num_stages)
        return out


class AttentionLauncher(Launcher):
    """softmax(q @ kt * scale, masked) @ v in one kernel (codegen/attention.py); Triton only."""

    def launch(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = attention_launch(self.spec, self.kernel, inputs)
        return self.fallback(*inputs) if out is None else out


@dataclass(frozen=True)
class KernelRecipe:
    """How a launcher was made: enough to make it again in another process (the
    graph cache, frontend/graph_cache.py), from the kernel's source alone."""

    target: str  # triton | openmp
    source: str
    launcher: str  # the Launcher class's name

    def build(self, spec: KernelSpec, fallback: Callable[..., torch.Tensor],
              lazy: bool = False) -> tuple[Launcher, Path]:
        """The launcher. `lazy` (a recipe that built before, in the graph cache)
        imports the Triton module only when a launch needs Triton's JIT."""
        cls: Any = _launcher_type(self.launcher)
        if self.target == "triton":
            path = triton_module(self.source)
            fn = _direct(self.source, spec.name, lazy)
            if self.launcher == "ReductionTritonLauncher":
                combine = _direct(self.source, f"{spec.name}_combine", lazy)
                launcher = cls(spec, fn, combine, fallback)
            else:
                launcher = cls(spec, fn, fallback)
        else:
            fn, path = build_cpp(self.source, spec.name)
            launcher = cls(spec, fn, fallback)
        launcher.recipe = self
        return launcher, path


def _direct(source: str, symbol: str, lazy: bool) -> DirectKernel:
    """A kernel launched through its compiled binary after its first call, and
    through a binary stored by an earlier process where one is (static_launch.py)."""
    binaries = None
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and static_launch.available():
        binaries = static_launch.Binaries(source, symbol)
    if lazy:
        return DirectKernel(load=lambda: load_triton(source, symbol)[0], binaries=binaries)
    return DirectKernel(load_triton(source, symbol)[0], binaries=binaries)


def launcher_class(spec: KernelSpec, target: str) -> str:
    if spec.template == "reduction":
        return "ReductionTritonLauncher" if target == "triton" else "ReductionCppLauncher"
    if target != "triton":
        return "CppLauncher"
    return {"matmul": "MatmulLauncher", "attention": "AttentionLauncher"}.get(
        spec.kind, "TritonLauncher")


def _launcher_type(name: str) -> type[Launcher]:
    # imported here: codegen/reduction_launch.py builds on this module's Launcher
    from .reduction_launch import ReductionCppLauncher, ReductionTritonLauncher

    types = (CppLauncher, TritonLauncher, MatmulLauncher, AttentionLauncher,
             ReductionCppLauncher, ReductionTritonLauncher)
    return next(c for c in types if c.__name__ == name)


def row_warps(block: int) -> int:
    """Warps for a persistent row: enough that a row of BLOCK_C values fits in
    registers (about 8 per thread) without spilling."""
    return max(1, min(32, block // 256))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class _Geometry:
    """What a launch needs to know of its inputs' sizes and strides."""

    shape: tuple[int, ...]  # the space in the graph's dim order
    keep: tuple[int, ...]  # shape with a row kernel's reduced dim set to 1
    perm: tuple[int, ...]  # space dim k is graph dim perm[k]
    space: tuple[int, ...]
    strides: tuple[int, ...]  # strided inputs' strides in the space's order
    # The output's sizes and strides in the graph's dim order: dense in the space's
    # order when that differs from the graph's
    out_size: tuple[int, ...]
    out_stride: tuple[int, ...]
    # Per input: None (passed as is), () (made contiguous), or a permutation to
    # read it flat in the space's order
    flat: tuple[tuple[int, ...] | None, ...]


def cached_geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...],
                    compute: Callable[[KernelSpec, tuple[torch.Tensor, ...]], Any]) -> Any:
    """`compute(spec, inputs)`, once per combination of input sizes and strides (a
    compiled graph sees the same few each call): a launch geometry costs more
    Python time than the launch itself (torch.broadcast_shapes alone ~30 us)."""
    key = tuple((x.shape, x.stride()) for x in inputs)
    cache = spec.meta.setdefault("geometry", {})
    geometry = cache.get(key)
    if geometry is None:
        geometry = compute(spec, inputs)
        if len(cache) < 64:
            cache[key] = geometry
    return geometry


def _geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...]) -> _Geometry:
    return cached_geometry(spec, inputs, _compute_geometry)


def _compute_geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...]) -> _Geometry:
    shape = list(torch.broadcast_shapes(*(x.shape for x in inputs)))
    dim = spec.meta.get("dim")
    if len(shape) < spec.rank:
        shape = [1] * (spec.rank - len(shape)) + shape
    if dim is not None and shape[dim] == 1:
        # every input is one value per row: the row length comes from the graph
        shape[dim] = int(spec.meta.get("cols", 1))
    order = spec.meta.get("order")
    perm = list(order) if order is not None and len(order) == len(shape) else \
        list(range(len(shape)))
    if dim is not None:
        perm = [k for k in perm if k != dim] + [dim]
    keep = list(shape)
    if dim is not None:
        keep[dim] = 1
    strides: list[int] = []
    for x, inp in zip(inputs, spec.inputs, strict=True):
        if not inp.flat:
            st = x.expand(keep if inp.per_row else shape).stride()
            strides.extend(st[k] for k in perm)
    space = tuple(shape[k] for k in perm)
    permuted = perm != list(range(len(perm)))
    out_size, out_stride = tuple(shape), dense_strides(shape)
    if spec.per_row_out:
        out_size, out_stride = tuple(keep), dense_strides(keep)
    elif permuted:
        # laid out in the space's order (a row kernel's reduced dim innermost, or the
        # root's layout in the graph, e.g. NHWC), seen in the graph's dim order
        dense = dense_strides(space)
        out_stride = tuple(dense[perm.index(k)] for k in range(len(perm)))
    # flat inputs are read by linear index: laid out densely in the space's order
    flat = tuple((tuple(perm) if permuted else ()) if inp.flat else None
                 for inp in spec.inputs)
    return _Geometry(tuple(shape), tuple(keep), tuple(perm), space, tuple(strides), out_size,
                     out_stride, flat)


def dense_strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides for `shape`."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


# Inductor's allocation helper: torch.empty_strided without the Python argument
# parser (~1 us against ~5), on the current CUDA device
try:
    from torch._C._dynamo.guards import _empty_strided_cuda as _EMPTY_STRIDED_CUDA
except ImportError:  # pragma: no cover - another torch: the public call
    _EMPTY_STRIDED_CUDA = None


def empty_strided(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A launch's output or scratch buffer."""
    if (device.type == "cuda" and _EMPTY_STRIDED_CUDA is not None
            and device.index == torch._C._cuda_getDevice()):
        return _EMPTY_STRIDED_CUDA(size, stride, dtype)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _prepare(spec: KernelSpec, inputs: tuple[torch.Tensor, ...], out_dtype: torch.dtype
             ) -> tuple[tuple[int, ...], torch.Tensor, list[torch.Tensor], tuple[int, ...]]:
    """Run-time sizes of the space (a row kernel's reduced dim moved last), the
    output, the inputs as passed, and their strides in the space's dim order."""
    g = _geometry(spec, inputs)
    device = inputs[0].device if inputs else torch.device("cpu")
    out = empty_strided(g.out_size, g.out_stride, out_dtype, device)
    tensors = []
    for x, flat in zip(inputs, g.flat, strict=True):
        if flat is None:
            tensors.append(x)
        else:
            if flat:
                x = x.permute(flat)
            tensors.append(x if x.is_contiguous() else x.contiguous())
    return g.space, out, tensors, g.strides


@dataclass
class Prepared:
    graph: Graph
    launchers: dict[Term, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0  # kernels that went back to their ATen body


def aten_body(kernel: Term, bridge: Bridge) -> Callable[..., torch.Tensor]:
    """The kernel's group run op by op through ATen (the launch-failure fallback)."""
    order = [t for t in kernel.attr("body").walk() if t.op not in ("arg", "const")]

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        values: dict[Term, Any] = {}
        for t in kernel.attr("body").walk():
            if t.op == "arg":
                values[t] = inputs[t.attr("index")]
            elif t.op == "const":
                values[t] = t.value
        for t in order:
            values[t] = bridge.run(t, [values[a] for a in t.args])
        return values[kernel.attr("body")]

    return run


def prepare_kernels(graph: Graph, store: TermStore, target: str, *, strict: bool,
                    out_dir: str | None, name: str, bridge: Bridge | None = None,
                    warn: Callable[[str], None] | None = None) -> Prepared:
    """Build every kernel term of `graph`; failed ones go back to their ATen body."""
    prepared = Prepared(graph)
    failed: dict[Term, Term] = {}
    order = graph.terms()
    for t in order:
        if t.op != "kernel":
            continue
        index = len(prepared.launchers) + len(failed)
        try:
            reduction = t.attr("template") == "reduction"
            attention = t.attr("template") == "attention"
            if attention and target != "triton":
                raise RenderError(f"no {target} template for attention")
            spec = (reduction_spec(t, index) if reduction else
                    attention_spec(t, index) if attention else spec_of(t, index))
            if spec.kind == "row":
                spec.meta["cols"] = _static(spec)
                if target == "triton" and looped(spec):
                    spec.template = "row_looped"
            elif spec.kind == "pointwise" and target == "triton" and spec.meta.get("tile") is not None:
                spec.template = "pointwise_tiled"  # a layout change: 2-d tiles (kernels.py)
            source = (render_reduction(spec, target) if reduction else
                      render_attention(spec) if attention else
                      render_row_looped(spec) if spec.template == "row_looped" else
                      render(spec, target))
            recipe = KernelRecipe(target, source, launcher_class(spec, target))
            launcher, path = recipe.build(spec, aten_body(t, bridge or Bridge()))
        except (RenderError, BuildError, KeyError, ValueError) as e:
            message = (f"rewritec: kernel for rule {t.attr('rule')} @ {t.attr('location')} "
                       f"(template {target}/{t.attr('template')}) falls back to ATen: {e}")
            if strict:
                from ..engine.errors import CompileError

                raise CompileError(message) from None
            (warn or (lambda m: warnings.warn(m, KernelFallback, stacklevel=3)))(message)
            failed[t] = inline_body(t, store)
            continue
        launcher.strict = strict
        prepared.launchers[t] = launcher
        if out_dir:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            ext = "py" if target == "triton" else "cpp"
            copy = out / f"{name}.{spec.name}.{ext}"
            copy.write_text(source)
            path = copy
        prepared.records.append({"name": spec.name, "target": target, "source": str(path),
                                 "rules": [spec.rule], "template": f"{target}/{spec.template}",
                                 "replaced_ops": spec.replaced_ops,
                                 "order": spec.meta.get("order")})
    if failed:
        prepared.graph = _substitute(graph, store, failed)
        prepared.failed = len(failed)
    return prepared


def _static(spec: KernelSpec) -> int:
    """The row length known at compile time (1 when it is symbolic)."""
    try:
        return int(spec.meta["shape"][spec.meta["dim"]])
    except (TypeError, KeyError, IndexError):
        return 1


def inline_body(kernel: Term, store: TermStore) -> Term:
    """The kernel's computation as ordinary terms over its operands."""
    done: dict[Term, Term] = {}
    for t in kernel.attr("body").walk():
        if t.op == "arg":
            done[t] = kernel.args[t.attr("index")]
        elif t.op == "const":
            done[t] = t
        else:
            done[t] = store.make(t.op, [done[a] for a in t.args], t.attrs, meta=t.meta)
    return done[kernel.attr("body")]


def _substitute(graph: Graph, store: TermStore, repl: dict[Term, Term]) -> Graph:
    """`graph` with each failed kernel replaced by its body over the new terms."""

    def replace(t: Term, new: dict[Term, Term]) -> Term | None:
        if t not in repl:
            return None
        memo: dict[Term, Term] = {}
        for u in repl[t].walk():
            if u in new:
                memo[u] = new[u]
            elif u.args:
                memo[u] = store.make(u.op, [memo[a] for a in u.args], u.attrs, meta=u.meta)
            else:
                memo[u] = u
        return memo[repl[t]]

    return rebuild(graph, store, replace)
