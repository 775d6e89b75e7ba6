"""Launching generated kernels: the launchers a compiled graph calls.

Each launcher allocates the outputs, computes sizes, strides and the grid at run
time from its `KernelSpec` (kinds/spec.py), and launches; a launch that fails
runs the group's ATen body instead. A kernel of one output returns that tensor;
one with side outputs (engine/fuse.py) the tuple of its outputs, the root's first,
and so does its ATen body. `KernelRecipe` (runtime/recipe.py) makes a launcher again from
the kernel's source, which is how the graph cache (runtime/graph_cache.py)
loads a compiled graph. This module imports neither the rule engine nor the
renderers, so such a load stays cheap; building launchers for a new graph is
runtime/prepare.py's work.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..aten.dtypes import TORCH_DTYPES
from ..engine.diag import user_stacklevel
from ..kinds import spec as kind_spec
from ..kinds.spec import GEOMETRY_CACHE, KernelSpec, block_pow2, broadcast_sizes, chunk
from .attention_launch import attention_launch
from .matmul_launch import matmul_launch_args
from .triton_direct import POISON


class KernelFallback(UserWarning):
    """A fused group runs through ATen because its kernel could not be built."""


class OutOfRange(IndexError, RuntimeError):  # noqa: N818 - eager's error, as eager raises it
    """A take's index outside its table (check_bounds): the caller's error, raised to
    the caller, as eager raises it; not a failed launch. An IndexError, as eager's
    embedding raises, and a RuntimeError, as eager's gather does (a take is either:
    rules/decompose/gathers.yaml)."""


class NoLaunch(Exception):  # noqa: N818 - a condition a launch meets, not a failure
    """This call cannot launch the kernel, though other calls may (a packaged kernel
    holding no binary for these sizes): it alone runs through ATen."""


Result = torch.Tensor | tuple[torch.Tensor, ...]


class Launcher:
    """Runs one kernel; if a launch fails (out of memory, a driver error), warns once
    and runs the group's ATen body instead, so the result is still correct."""

    spec: KernelSpec
    fallback: Callable[..., Result]
    failed: bool = False
    strict: bool = False
    calls_fell_back = 0  # calls that could not launch it (NoLaunch) and ran through ATen
    recipe: Any = None  # the KernelRecipe it was made from (runtime/recipe.py)

    def __init__(self, spec: KernelSpec, kernel: Any,
                 fallback: Callable[..., Result]) -> None:
        self.spec = spec
        self.kernel = kernel
        self.fallback = fallback

    # Launch plans by input signature (`_signature`): at most PLANS per launcher
    plans: dict[Any, Any] | None = None  # _Plan, _Steps or NO_PLAN
    PLANS = 16
    attempts = 0

    def __call__(self, *inputs: torch.Tensor) -> Result:
        plans = self.plans
        if plans is not None:
            try:
                key = _signature(inputs)
            except AttributeError:  # an input that is not a tensor: no plan for it
                return self._launch_or_fallback(inputs)
            plan = plans.get(key)
            if plan is not None:
                if plan is NO_PLAN:
                    return self._launch_or_fallback(inputs)
                try:
                    return plan.launch(inputs)
                except Exception:  # noqa: BLE001 - the full path below decides
                    self.plans = None
            elif len(plans) < self.PLANS and not self.failed:
                return self._learn(key, inputs)
        return self._launch_or_fallback(inputs)

    def launch(self, *inputs: torch.Tensor) -> Result:
        raise NotImplementedError

    def plan_for(self, inputs: tuple[Any, ...]) -> Any:
        """The plan a call with `inputs` replays (`_Plan`, `_Steps`), if one was
        learned: what runtime/graph_plans.py writes out in its place."""
        if self.plans is None:
            return None
        try:
            return self.plans.get(_signature(inputs))
        except AttributeError:  # an input that is not a tensor
            return None

    # each input's dtype as the kernel was rendered for it (launchers that check them)
    in_dtypes: list[torch.dtype] = []

    def check_dtypes(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """A kernel is rendered for each input's dtype (a C++ kernel reads the bytes
        as that type, whatever the tensor holds); where a tensor is not of it (a fake
        tensor's dtype that the real op does not give: the running statistics of a
        bf16 batch norm on the CPU), this call runs through ATen (NoLaunch)."""
        for x, want in zip(inputs, self.in_dtypes, strict=True):
            if x.dtype != want:
                raise NoLaunch(f"an input is {x.dtype}, the kernel reads {want}")

    # While a launch is learned, the scratch tensors it allocates (a split
    # reduction's partial results): a plan allocates them afresh at each call
    temps: list[torch.Tensor] | None = None

    def watched(self) -> tuple[Any, ...]:
        """The kernels a launch may run, in any order and number (a split reduction:
        the kernel, then its combine)."""
        return (self.kernel,)

    def _learn(self, key: Any, inputs: tuple[torch.Tensor, ...]) -> Result:
        """Launch as usual, watching the kernels: a call whose every launch went
        through a remembered runner, with arguments that are the inputs themselves,
        the fresh outputs (every one of a kernel with side outputs), scratch tensors
        the launch allocated and numbers, becomes this signature's plan. A launch that
        passes any other tensor (an input made contiguous first) never will: NO_PLAN,
        so the signature is not watched again."""
        kernels = self.watched()
        seen: list[Any] = []
        temps: list[torch.Tensor] = []
        before = [_launches(k) for k in kernels]
        fell_back = self.calls_fell_back
        for k in kernels:
            k.watch = seen
        self.temps = temps
        try:
            result = self._launch_or_fallback(inputs)
        finally:
            for k in kernels:
                k.watch = None
            self.temps = None
        self.attempts += 1
        if self.attempts > 2 * self.PLANS and self.plans is not None and not self.plans:
            self.plans = None  # never learned (the JIT launches, or several kernels)
        outs = result if isinstance(result, tuple) else (result,)
        if self.plans is None or not seen or POISON in seen or self.failed or \
                self.calls_fell_back != fell_back or any(
                o.device.type != PLAN_DEVICE or _index(o) != key[0] for o in outs):
            return result
        after = [_launches(k) for k in kernels]
        if None in before or None in after:
            counted = len(seen) == 1 and len(kernels) == 1  # a kernel without counters
        else:
            counted = sum(after) - sum(before) == len(seen)  # type: ignore[arg-type]
        if counted:
            self.plans[key] = _make_plan(seen, inputs, outs, temps)
        return result

    def _launch_or_fallback(self, inputs: tuple[torch.Tensor, ...]) -> Result:
        if not self.failed:
            try:
                return self.launch(*inputs)
            except OutOfRange:
                raise
            except NoLaunch as e:
                if self.strict:
                    raise
                if not self.calls_fell_back:
                    warnings.warn(f"rewritec: kernel {self.spec.name} (rule {self.spec.rule}) "
                                  f"runs a call through ATen: {e}", KernelFallback,
                                  stacklevel=user_stacklevel())
                self.calls_fell_back += 1
            except Exception as e:
                if self.strict:
                    raise
                self.failed = True
                warnings.warn(f"rewritec: kernel {self.spec.name} (rule {self.spec.rule}) "
                              f"failed at launch and falls back to ATen: "
                              f"{type(e).__name__}: {e}", KernelFallback,
                              stacklevel=user_stacklevel())
        return self.fallback(*inputs)


@dataclass(frozen=True)
class _Plan:
    """One launch learned by `Launcher._learn`: each output's size, strides and dtype
    (the root's first, then any side outputs), the kernel's runner and the numbers
    after the outputs (sizes, strides, then the constexprs), for a runner that takes
    the inputs, then the outputs, then numbers. Everything in it follows from the
    signature it is kept under."""

    outs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
    run: Callable[..., Any]
    rest: tuple[Any, ...]

    def launch(self, inputs: tuple[torch.Tensor, ...]) -> Result:
        outs = [_plan_alloc(*o) for o in self.outs]
        self.run(*inputs, *outs, *self.rest)
        return _result(outs)


# An argument of a learned launch (`_Steps`): the n-th input, the n-th output, the
# n-th scratch tensor, or a value passed as it is.
_IN, _OUT, _TEMP, _VALUE = range(4)

# A tensor's size, strides and dtype: what a plan allocates it from
_Alloc = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class _Steps:
    """Several launches learned by `Launcher._learn` (a split reduction and its
    combine), or one whose arguments are not inputs-outputs-numbers: the outputs
    and the scratch tensors are allocated afresh, then each runner called in order."""

    outs: tuple[_Alloc, ...]
    temps: tuple[_Alloc, ...]
    steps: tuple[tuple[Callable[..., Any], tuple[tuple[int, Any], ...]], ...]

    def launch(self, inputs: tuple[torch.Tensor, ...]) -> Result:
        outs = [_plan_alloc(*o) for o in self.outs]
        temps = [_plan_alloc(*t) for t in self.temps]
        for run, slots in self.steps:
            run(*[inputs[v] if k == _IN else outs[v] if k == _OUT else temps[v]
                  if k == _TEMP else v for k, v in slots])
        return _result(outs)


# The plan of a signature whose launch cannot be replayed: launch it the full way
NO_PLAN: Any = object()


def _result(outs: list[torch.Tensor]) -> Result:
    """What a launch returns: the one output itself, or the tuple of several."""
    return outs[0] if len(outs) == 1 else tuple(outs)


def _alloc_of(t: torch.Tensor) -> _Alloc:
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _make_plan(seen: list[Any], inputs: tuple[torch.Tensor, ...],
               outs: tuple[torch.Tensor, ...], temps: list[torch.Tensor]) -> Any:
    """The plan replaying the watched launches `seen`, or NO_PLAN. `outs`: what the
    launch returned, the root's output first (more than one with side outputs)."""
    n, k = len(inputs), len(outs)
    if len(seen) == 1:
        run, args, tail = seen[0]
        rest = args[n + k:]
        if len(args) >= n + k and all(
                a is b for a, b in zip(args[:n + k], (*inputs, *outs), strict=True)) \
                and not any(isinstance(a, torch.Tensor) for a in rest):
            return _Plan(tuple(_alloc_of(o) for o in outs), run, (*rest, *tail))
    if any(t.device != outs[0].device for t in temps):
        return NO_PLAN  # a plan allocates on the current device only
    ids = {id(x): (_IN, i) for i, x in reversed(list(enumerate(inputs)))}
    ids.update({id(t): (_TEMP, j) for j, t in enumerate(temps)})
    ids.update({id(o): (_OUT, j) for j, o in enumerate(outs)})
    steps = []
    for run, args, tail in seen:
        slots = []
        for a in (*args, *tail):
            if isinstance(a, torch.Tensor):
                slot = ids.get(id(a))
                if slot is None:
                    return NO_PLAN  # a tensor made during the launch (a contiguous copy)
                slots.append(slot)
            else:
                slots.append((_VALUE, a))
        steps.append((run, tuple(slots)))
    return _Steps(tuple(_alloc_of(o) for o in outs), tuple(_alloc_of(t) for t in temps),
                  tuple(steps))


def _launches(kernel: Any) -> int | None:
    """How many launches `kernel` made so far (a DirectKernel's counters), or None."""
    direct, jitted = getattr(kernel, "direct", None), getattr(kernel, "jitted", None)
    if not isinstance(direct, int) or not isinstance(jitted, int):
        return None
    return direct + jitted


def _signature(inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What a launch's plan depends on: the current device and, per input, its
    sizes, strides, dtype and address modulo 16 (Triton specializes on alignment)."""
    return (_plan_device(),
            *[(x.shape, x.stride(), x.dtype, x.data_ptr() & 15) for x in inputs])


# Plans are made for CUDA launches: outputs of the current device, allocated without
# the Python argument parser (tests point these at the CPU)
PLAN_DEVICE = "cuda"


def _plan_device() -> int:
    return torch._C._cuda_getDevice()


def _index(t: torch.Tensor) -> int:
    """A tensor's device index as `_plan_device` gives the current one: a plan
    allocates on the current device, so one learned elsewhere is never kept."""
    index = t.device.index
    return -1 if index is None else index


def _plan_alloc(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
                ) -> torch.Tensor:
    return _EMPTY_STRIDED_CUDA(size, stride, dtype)


@dataclass(frozen=True)
class _CppPlan:
    """An OpenMP kernel's launch for one input signature (`_cpp_signature`): its
    outputs' sizes, strides and dtypes, the kernel (a ctypes function taking the
    inputs' and outputs' addresses, then integers) and the integers, None where the
    outputs are empty and nothing is launched. Learned by `CppLauncher` from a launch
    that passed its inputs as they are."""

    outs: tuple[_Alloc, ...]
    fn: Any
    ints: tuple[int, ...] | None
    bounds: tuple[tuple[int, int], ...] = ()  # the kernel's index inputs (check_bounds)

    def launch(self, inputs: tuple[torch.Tensor, ...]) -> Result:
        if self.bounds:
            check_bounds(inputs, self.bounds)
        outs = [_cpu_alloc(*o) for o in self.outs]
        if self.ints is not None:
            self.fn(*[x.data_ptr() for x in inputs], *[o.data_ptr() for o in outs],
                    *self.ints)
        return _result(outs)


def check_bounds(inputs: Sequence[torch.Tensor], bounds: Iterable[tuple[int, int]]) -> None:
    """Raise IndexError, as eager's embedding does, where index input k of a take
    holds a value outside [0, n), for each (k, n) of `bounds` (kinds/kernels.py:
    spec_of). The OpenMP launcher checks before its launch, so a kernel never reads
    past its table; on the GPU the Triton kernel asserts it on the device."""
    for k, n in bounds:
        x = inputs[k]
        if x.numel():
            lo, hi = (int(v) for v in torch.aminmax(x))  # ints: cheaper than tensor tests
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise OutOfRange(f"index out of range in self: {bad} is not in [0, {n})")


def _cpp_signature(inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What an OpenMP launch depends on: each input's sizes, strides and dtype (its
    kernel reads any address; it runs on the CPU only)."""
    return tuple([(x.shape, x.stride(), x.dtype) for x in inputs])


def _cpu_alloc(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
               ) -> torch.Tensor:
    if _EMPTY_STRIDED_CPU is not None:
        return _EMPTY_STRIDED_CPU(size, stride, dtype)
    return torch.empty_strided(size, stride, dtype=dtype)  # pragma: no cover


class CppLauncher(Launcher):
    """Runs an OpenMP kernel. The first launch of each input signature works out the
    geometry and checks the dtypes; where it passed the inputs as they are (no copy
    made contiguous), the outputs' layouts and the integers are kept as that
    signature's `_CppPlan`, and later launches of it only allocate and call."""

    PLANS = 16
    cpp_plans: dict[Any, _CppPlan]
    # while a signature's first launch runs: the integers it passed, if it passed the
    # inputs as they are
    learned: list[tuple[int, ...] | None] | None = None

    def __init__(self, spec: KernelSpec, fn: Any, fallback: Callable[..., Result]) -> None:
        self.spec = spec
        self.fn = fn
        self.fallback = fallback
        n_ptr = len(spec.inputs) + len(spec.outputs)
        n_int = spec.rank + sum(spec.rank for i in spec.inputs if not i.flat) + 2
        self._cpp_types(n_ptr, n_int)

    @property
    def fn(self) -> Any:
        return self._fn

    @fn.setter
    def fn(self, fn: Any) -> None:
        self._fn = fn
        self.cpp_plans = {}  # they call the kernel they were learned with

    def _cpp_types(self, n_ptr: int, n_int: int) -> None:
        self.fn.argtypes = [ctypes.c_void_p] * n_ptr + [ctypes.c_int64] * n_int
        self.fn.restype = None
        self.out_dtypes = [TORCH_DTYPES[o.dtype] for o in self.spec.outputs]
        self.in_dtypes = [TORCH_DTYPES[i.dtype] for i in self.spec.inputs]

    def __call__(self, *inputs: torch.Tensor) -> Result:
        try:
            key = _cpp_signature(inputs)
        except AttributeError:  # an input that is not a tensor: no plan for it
            return self._launch_or_fallback(inputs)
        plan = self.cpp_plans.get(key)
        if plan is not None:
            try:
                return plan.launch(inputs)
            except OutOfRange:
                raise
            except Exception:  # noqa: BLE001 - the full path below decides
                self.cpp_plans = {}
        if len(self.cpp_plans) >= self.PLANS or self.failed:
            return self._launch_or_fallback(inputs)
        learned: list[tuple[int, ...] | None] = []
        fell_back = self.calls_fell_back
        self.learned = learned
        try:
            result = self._launch_or_fallback(inputs)
        finally:
            self.learned = None
        if len(learned) == 1 and not self.failed and self.calls_fell_back == fell_back:
            outs = result if isinstance(result, tuple) else (result,)
            self.cpp_plans[key] = _CppPlan(tuple(_alloc_of(o) for o in outs), self.fn,
                                           learned[0], self.spec.meta.get("bounds", ()))
        return result

    def plan_for(self, inputs: tuple[Any, ...]) -> Any:
        try:
            return self.cpp_plans.get(_cpp_signature(inputs))
        except AttributeError:
            return None

    def _call(self, inputs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
              outs: list[torch.Tensor], ints: tuple[int, ...] | None) -> Result:
        """Launch on `tensors` (the inputs as the kernel reads them) unless `ints` is
        None (empty outputs), noting the integers for a plan being learned."""
        if self.learned is not None and tensors is inputs:
            self.learned.append(ints)
        bounds = self.spec.meta.get("bounds")
        if bounds:
            check_bounds(inputs, bounds)
        if ints is not None:
            self.fn(*[t.data_ptr() for t in tensors], *[o.data_ptr() for o in outs], *ints)
        return _result(outs)

    def launch(self, *inputs: torch.Tensor) -> Result:
        self.check_dtypes(inputs)
        g, outs, tensors = _prepare(self.spec, inputs, self.out_dtypes)
        return self._call(inputs, tensors, outs, g.cpp_ints if g.numel else None)


class TritonLauncher(Launcher):
    BLOCK_SIZE = 1024
    TILE_Y = 64  # tiled pointwise kernels (layout changes): 64 x 64 values a program
    TILE_X = 64

    def __init__(self, spec: KernelSpec, kernel: Any,
                 fallback: Callable[..., Result]) -> None:
        super().__init__(spec, kernel, fallback)
        self.out_dtypes = [TORCH_DTYPES[o.dtype] for o in spec.outputs]
        self.in_dtypes = [TORCH_DTYPES[i.dtype] for i in spec.inputs]

    def launch(self, *inputs: torch.Tensor) -> Result:
        self.check_dtypes(inputs)
        bounds = self.spec.meta.get("bounds")
        if bounds and inputs[0].device.type == "cpu":
            check_bounds(inputs, bounds)  # Triton's interpreter skips device asserts
        g, outs, tensors = _prepare(self.spec, inputs, self.out_dtypes)
        if g.numel:
            self._run(g, outs, tensors)
        return _result(outs)

    def _run(self, g: _Geometry, outs: list[torch.Tensor], tensors: Sequence[torch.Tensor]
             ) -> None:
        """A pointwise kernel (kinds/pointwise.py): one flat loop over the elements."""
        n = g.numel
        grid = (triton_cdiv(n, self.BLOCK_SIZE),)
        self.kernel[grid](*tensors, *outs, n, *g.space, *g.strides, BLOCK_SIZE=self.BLOCK_SIZE)


class TiledTritonLauncher(TritonLauncher):
    """A pointwise kernel in 2-d tiles (kinds/pointwise_tiled.py)."""

    def _run(self, g: _Geometry, outs: list[torch.Tensor], tensors: Sequence[torch.Tensor]
             ) -> None:
        space, tile = g.space, int(self.spec.meta["tile"])
        # kinds/pointwise_tiled.py: _tiled_offsets; tiles over space dims `tile` and the last
        tiles = triton_cdiv(space[tile], self.TILE_Y) * triton_cdiv(space[-1], self.TILE_X)
        grid = (g.numel // (space[tile] * space[-1]) * tiles,)
        self.kernel[grid](*tensors, *outs, g.numel, *space, *g.strides,
                          BLOCK_Y=self.TILE_Y, BLOCK_X=self.TILE_X)


class RowTritonLauncher(TritonLauncher):
    """A row kernel (kinds/row.py): one program per row, the row in registers."""

    def block(self, cols: int) -> int:
        return block_pow2(cols)

    def _run(self, g: _Geometry, outs: list[torch.Tensor], tensors: Sequence[torch.Tensor]
             ) -> None:
        space = g.space
        cols = space[-1]
        rows = _numel(space) // cols
        self._launch_rows(rows, self.block(cols), (*tensors, *outs, cols, *space, *g.strides))

    def _launch_rows(self, rows: int, block: int, args: tuple[Any, ...]) -> None:
        self.kernel[(rows,)](*args, BLOCK_C=block, num_warps=self.warps(block))

    def warps(self, block: int) -> int:
        return row_warps(block)


class LoopedRowTritonLauncher(RowTritonLauncher):
    """A row read in chunks (kinds/row_looped.py)."""

    def block(self, cols: int) -> int:
        return chunk(self.spec, block_pow2(cols))

    def warps(self, block: int) -> int:
        # A whole row of 16K-32K columns is read fastest by 32 warps; a chunk of 8K or
        # less (a 50K-wide row's, or a whole 8K row) by no more than 16: at 32, one
        # program of 1024 threads per SM, a 50K-wide row ran 30-45% slower and a
        # 4096 x 8192 bf16 layer_norm 0.071 against 0.060 ms on an H100
        # (kinds/spec.py: STATIC_WHOLE_ROW_C).
        if block > kind_spec.STATIC_LOOPED_BLOCK_C:
            return row_warps(block)
        return min(LOOPED_ROW_MAX_WARPS, row_warps(block))


class MultiRowTritonLauncher(RowTritonLauncher):
    """Narrow rows, ROWS a program (kinds/row_multi.py)."""

    def _launch_rows(self, rows: int, block: int, args: tuple[Any, ...]) -> None:
        per = rows_per_program(block, rows)
        self.kernel[(triton_cdiv(rows, per),)](*args, ROWS=per, BLOCK_C=block,
                                               num_warps=self.warps(per * block))

    def warps(self, block: int) -> int:
        # half a persistent row's: on an H200 (CUDA-graph replay, bf16) 2048 values
        # a program read by 4 warps beat 8 on every width tried, 49 to 768 columns
        return max(2, min(8, block // 512))


class MatmulLauncher(Launcher):
    """A matrix product with its epilogue (kinds/matmul.py); Triton only."""

    def launch(self, *inputs: torch.Tensor) -> Result:
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
    """softmax(q @ kt * scale, masked) @ v in one kernel (kinds/attention.py); Triton only."""

    def launch(self, *inputs: torch.Tensor) -> Result:
        out = attention_launch(self.spec, self.kernel, inputs)
        return self.fallback(*inputs) if out is None else out


# Warps of a looped row kernel's program (LoopedRowTritonLauncher.warps)
LOOPED_ROW_MAX_WARPS = 16


def row_warps(block: int) -> int:
    """Warps for a persistent row: enough that a row of BLOCK_C values fits in
    registers (about 8 per thread) without spilling."""
    return max(1, min(32, block // 256))


# Values a program of a multi-row kernel holds (ROWS x BLOCK_C), and the fewest
# programs it keeps while it can (a narrow softmax of few rows still fills the GPU).
# H200, bf16, us a call under CUDA-graph replay, 1024 / 2048 / 4096 values (4 warps)
# and Inductor: softmax(x + b) over 2048x3x49x49 68.1 / 67.8 / 72.7 and 58.5;
# layer_norm 100352x96 9.7 / 9.4 / 9.4 and 9.6, 25088x192 5.5 / 5.2 / 5.4 and 5.5,
# 6272x384 3.9 / 3.7 / 3.7 and 3.5, 8192x768 7.7 / 7.1 / 7.2 and 6.8 (one row a
# program: 182.5, 61.7, 16.4, 5.5, 7.8).
MULTI_ROW_VALUES = 2048
MULTI_ROW_MIN_PROGRAMS = 1024


def rows_per_program(block: int, rows: int) -> int:
    """ROWS of a multi-row kernel: a power of two, MULTI_ROW_VALUES // block at
    most, halved while that leaves fewer than MULTI_ROW_MIN_PROGRAMS programs."""
    per = max(1, MULTI_ROW_VALUES // block)
    while per > 1 and rows < per * MULTI_ROW_MIN_PROGRAMS:
        per //= 2
    return per


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
    # Each output's sizes and strides in the graph's dim order: dense in the space's
    # order when that differs from the graph's (a per-row output: in the graph's)
    outs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    # Per input: None (passed as is), () (made contiguous), or a permutation to
    # read it flat in the space's order
    flat: tuple[tuple[int, ...] | None, ...]
    numel: int  # the largest output's: 0, nothing to launch
    # Every input passed as it is (those read flat already are laid out so): the
    # common case, which skips the per-input work at each launch
    direct: bool
    # An OpenMP kernel's integer arguments: sizes, strides, the count of elements
    # (pointwise) or rows, and the row length
    cpp_ints: tuple[int, ...]


def cached_geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...],
                    compute: Callable[[KernelSpec, tuple[torch.Tensor, ...]], Any]) -> Any:
    """`compute(spec, inputs)`, once per combination of input sizes and strides (a
    compiled graph sees the same few each call): a launch geometry costs more
    Python time than the launch itself (torch.broadcast_shapes alone ~30 us)."""
    key = tuple((x.shape, x.stride()) for x in inputs)
    cache = spec.meta.setdefault(GEOMETRY_CACHE, {})
    geometry = cache.get(key)
    if geometry is None:
        geometry = compute(spec, inputs)
        if len(cache) < 64:
            cache[key] = geometry
    return geometry


def _geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...]) -> _Geometry:
    return cached_geometry(spec, inputs, _compute_geometry)


def _compute_geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...]) -> _Geometry:
    # A kernel with indexed ops (kinds/indexed.py) reads inputs of other shapes than
    # its own (a cat's pieces): its shape, static, is the spec's
    indexed = bool(spec.meta.get("indexed"))
    shape = list(spec.meta["shape"]) if indexed or spec.meta.get("filled") else \
        broadcast_sizes([x.shape for x in inputs])
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
            st = _broadcast_strides(x, len(shape)) if indexed else \
                x.expand(keep if inp.per_row else shape).stride()
            strides.extend(st[k] for k in perm)
    space = tuple(shape[k] for k in perm)
    permuted = perm != list(range(len(perm)))
    full = (tuple(shape), dense_strides(shape))
    if permuted:
        # laid out in the space's order (a row kernel's reduced dim innermost, or the
        # root's layout in the graph, e.g. NHWC), seen in the graph's dim order
        dense = dense_strides(space)
        full = (tuple(shape), tuple(dense[perm.index(k)] for k in range(len(perm))))
    outs = tuple((tuple(keep), dense_strides(keep)) if o.per_row else full
                 for o in spec.outputs)
    # flat inputs are read by linear index: laid out densely in the space's order
    flat = tuple((tuple(perm) if permuted else ()) if inp.flat else None
                 for inp in spec.inputs)
    # sizes and strides are part of the cache key, so whether a flat input is already
    # laid out so is known here, once
    direct = all(f is None or (x.permute(f) if f else x).is_contiguous()
                 for x, f in zip(inputs, flat, strict=True))
    numel = max(_numel(size) for size, _ in outs)
    # the C++ kernel's rows: the innermost dims merged where every strided input
    # reads them contiguously (H and W of NCHW, a per-channel scale's zeros too)
    rows = space if dim is not None or indexed else _merged_rows(space, strides)
    cols = rows[-1] if rows else 1
    count = (_numel(rows) // cols if cols else 0) if spec.by_rows else numel
    # (a merged dim is left of size 1, which adds nothing to an offset: strides stay)
    return _Geometry(tuple(shape), tuple(keep), tuple(perm), space, tuple(strides), outs,
                     flat, numel, direct, (*rows, *strides, count, cols))


def _merged_rows(space: tuple[int, ...], strides: list[int]) -> tuple[int, ...]:
    """`space` with the dims before the innermost merged into it where every strided
    input reads them contiguously (`merge_inner`): the same elements in the same order,
    in longer rows. `strides`: each strided input's, in the space's order."""
    if len(space) < 2:
        return space
    sizes = list(space)
    merge_inner(sizes, strides, range(0, len(strides), len(space)))
    return tuple(sizes)


def merge_inner(sizes: list[int], strides: Sequence[int], starts: Iterable[int],
                first: int = 0) -> None:
    """Merge dims `first`.. of `sizes` into the last one, innermost first, while every
    block of `strides` (the dims' strides from each offset of `starts`) steps over a
    dim as over the last one's whole extent: its stride the last's times the last's
    size. Merged dims are left of size 1, in place."""
    last, starts = len(sizes) - 1, list(starts)
    for k in range(last - 1, first - 1, -1):
        if sizes[k] == 1:
            continue
        if not all(strides[b + k] == strides[b + last] * sizes[last] for b in starts):
            break
        sizes[last] *= sizes[k]
        sizes[k] = 1


def _broadcast_strides(x: torch.Tensor, rank: int) -> tuple[int, ...]:
    """x's strides aligned to `rank` dims as broadcasting aligns them, 0 where x has
    size 1: what `expand` gives, for an x of any sizes."""
    lead = (0,) * (rank - x.dim())
    return lead + tuple(0 if n == 1 else st for n, st in zip(x.shape, x.stride(), strict=True))


def dense_strides(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides for `shape`."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


# Inductor's allocation helpers: torch.empty_strided without the Python argument
# parser (~1 us against ~5 on the current CUDA device; 0.4 against 1.0 on the CPU)
try:
    from torch._C._dynamo.guards import (  # type: ignore[attr-defined]
        _empty_strided_cpu as _EMPTY_STRIDED_CPU,
    )
    from torch._C._dynamo.guards import (  # type: ignore[attr-defined]
        _empty_strided_cuda as _EMPTY_STRIDED_CUDA,
    )
except ImportError:  # pragma: no cover - another torch: the public call
    _EMPTY_STRIDED_CPU = _EMPTY_STRIDED_CUDA = None


def empty_strided(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A launch's output or scratch buffer."""
    if device.type == "cpu" and _EMPTY_STRIDED_CPU is not None:
        return _EMPTY_STRIDED_CPU(size, stride, dtype)
    if (device.type == "cuda" and _EMPTY_STRIDED_CUDA is not None
            and device.index == torch._C._cuda_getDevice()):
        return _EMPTY_STRIDED_CUDA(size, stride, dtype)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _prepare(spec: KernelSpec, inputs: tuple[torch.Tensor, ...], out_dtypes: list[torch.dtype]
             ) -> tuple[_Geometry, list[torch.Tensor], Sequence[torch.Tensor]]:
    """The launch's geometry (the space's sizes, a row kernel's reduced dim moved
    last, and the strided inputs' strides in its dim order), the outputs, and the
    inputs as the kernel reads them."""
    g = _geometry(spec, inputs)
    device = inputs[0].device if inputs else torch.device("cpu")
    outs = [empty_strided(size, stride, dtype, device)
            for (size, stride), dtype in zip(g.outs, out_dtypes, strict=True)]
    if g.direct:
        return g, outs, inputs
    tensors = []
    for x, flat in zip(inputs, g.flat, strict=True):
        if flat is None:
            tensors.append(x)
        else:
            if flat:
                x = x.permute(flat)
            tensors.append(x if x.is_contiguous() else x.contiguous())
    return g, outs, tensors
