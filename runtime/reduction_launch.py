"""Launchers for the `reduction` template (kinds/reduction.py): run-time
sizes and strides with the kept dims first and the reduced dims last, block
sizes, and on the GPU the split of a long reduction over many programs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..aten.dtypes import TORCH_DTYPES
from ..kinds.spec import KernelSpec, broadcast_sizes, stride_params
from .launch import (
    CppLauncher,
    Launcher,
    Result,
    _numel,
    _result,
    cached_geometry,
    dense_strides,
    empty_strided,
    merge_inner,
    triton_cdiv,
)


class ReductionCppLauncher(CppLauncher):
    """The `reduction` template on the CPU (kinds/reduction.py)."""

    def __init__(self, spec: KernelSpec, fn: Any, fallback: Callable[..., torch.Tensor]) -> None:
        self.spec = spec
        self.fn = fn
        self.fallback = fallback
        self._cpp_types(len(spec.inputs) + len(spec.outputs),
                        spec.rank + len(stride_params(spec)) + 2)

    def launch(self, *inputs: torch.Tensor) -> Result:
        self.check_dtypes(inputs)
        space, outs, tensors, strides, n_out, n_red, _ = _prepare_reduction(
            self.spec, inputs, self.out_dtypes, merged=True)
        ints = None if outs[0].numel() == 0 else (*space, *strides, n_out, n_red)
        return self._call(inputs, tensors, outs, ints)


class ReductionTritonLauncher(Launcher):
    """The `reduction` template on the GPU. Few outputs and a long reduction
    (`x.sum()`, a bias gradient) would leave most of the GPU idle, so the
    reduction index is split over up to SPLIT_MAX programs per block of
    outputs, each reading at least SPLIT_MIN_ELEMENTS elements; NAME_combine
    then reduces their partial results (in the compute dtype) and runs the
    epilogue."""

    TILE = 4096  # elements per [BLOCK_O, BLOCK_R] accumulator: 16 a thread at 8 warps
    SPLIT_MIN_ELEMENTS = 16384  # fewer, and the partial results cost more than they save
    SPLIT_MAX = 1024
    PROGRAMS = 4  # programs to aim for per SM (the interpreter: per 32 "SMs")

    def __init__(self, spec: KernelSpec, kernel: Any, combine: Any,
                 fallback: Callable[..., torch.Tensor]) -> None:
        self.spec = spec
        self.kernel = kernel
        self.combine = combine
        self.fallback = fallback
        self.out_dtypes = [TORCH_DTYPES[o.dtype] for o in spec.outputs]
        self.compute = TORCH_DTYPES[spec.compute]

    def watched(self) -> tuple[Any, ...]:
        return (self.kernel, self.combine)

    def launch(self, *inputs: torch.Tensor) -> Result:
        space, outs, tensors, strides, n_out, n_red, inner = _prepare_reduction(
            self.spec, inputs, self.out_dtypes)
        out = outs[0]
        if out.numel() == 0:
            return _result(outs)
        block_o, block_r = self.blocks(n_out, n_red, inner)
        programs_o = triton_cdiv(n_out, block_o)
        split, per_program = self.split(programs_o, n_red, block_o, block_r, out.device)
        args = (*tensors, *outs, *space, *strides, n_out, n_red)
        warps = 8 if block_o * block_r >= 2048 else 4
        if split == 1:
            self.kernel[(programs_o, 1)](*args, per_program, out, SPLIT=False,
                                         BLOCK_O=block_o, BLOCK_R=block_r, num_warps=warps)
            return _result(outs)
        size = (self.spec.meta["accumulators"], split, n_out)
        part = empty_strided(size, dense_strides(size), self.compute, out.device)
        if self.temps is not None:  # a plan being learned allocates it at each call
            self.temps.append(part)
        self.kernel[(programs_o, split)](*args, per_program, part, SPLIT=True,
                                         BLOCK_O=block_o, BLOCK_R=block_r, num_warps=warps)
        block_s = min(_pow2(split), 256)
        block_o = min(_pow2(n_out), max(1, 2048 // block_s))
        self.combine[(triton_cdiv(n_out, block_o),)](*args, split, part, BLOCK_O=block_o,
                                                    BLOCK_S=block_s, num_warps=4)
        return _result(outs)

    def blocks(self, n_out: int, n_red: int, inner: bool) -> tuple[int, int]:
        """(BLOCK_O, BLOCK_R): long along the reduction when it is the contiguous
        axis (`x.sum(-1)`), long along the outputs when they are (`x.sum(0)`)."""
        # more than two accumulators (sibling reductions in one kernel) in registers:
        # tiles half as large
        tile = self.TILE if self.spec.meta["accumulators"] <= 2 else self.TILE // 2
        if inner:
            block_r = min(_pow2(n_red), tile)
            return min(_pow2(n_out), max(1, tile // block_r)), block_r
        block_o = min(_pow2(n_out), 64)
        return block_o, min(_pow2(n_red), tile // block_o)

    def split(self, programs_o: int, n_red: int, block_o: int, block_r: int,
              device: torch.device) -> tuple[int, int]:
        """(programs per block of outputs, reduction elements per program: a
        multiple of BLOCK_R)."""
        target = self.PROGRAMS * _sm_count(device)
        split = 1 if programs_o >= target else max(1, min(
            triton_cdiv(target, programs_o), n_red * block_o // self.SPLIT_MIN_ELEMENTS,
            self.SPLIT_MAX))
        per_program = triton_cdiv(triton_cdiv(max(n_red, 1), split), block_r) * block_r
        return triton_cdiv(max(n_red, 1), per_program), per_program


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _sm_count(device: torch.device) -> int:
    if device.type == "meta" and torch.cuda.is_available():
        # runtime/ahead.py predicts a CUDA launch on meta tensors
        device = torch.device("cuda")
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else
                              torch.cuda.current_device())
    return 32


@functools.cache
def _cuda_sm_count(index: int) -> int:
    # read once per device: get_device_properties costs some us on every launch
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class _ReductionGeometry:
    """What a reduction launch needs of its inputs' sizes and strides."""

    space: tuple[int, ...]  # kept dims first, reduced dims last
    out_shape: tuple[int, ...]
    out_stride: tuple[int, ...]  # dense
    flat: tuple[bool, ...]  # per input: passed contiguous, read by linear index
    strides: tuple[int, ...]  # in launch order (kinds/reduction.py: stride_params)
    n_out: int
    n_red: int
    inner: bool
    # every input that is read flat is contiguous already (known from the sizes and
    # strides that key the geometry): the inputs are passed as they are
    direct: bool
    # the space with the reduced dims every strided prologue input reads contiguously
    # merged into the innermost (launch.merge_inner), the others left of size 1: the
    # same elements in the same order, read in longer runs (kinds/reduction.py:
    # _cpp_runs). A dim of size 1 adds nothing to an offset, so the strides stay.
    merged_space: tuple[int, ...] = ()


def _prepare_reduction(spec: KernelSpec, inputs: tuple[torch.Tensor, ...],
                       out_dtypes: list[torch.dtype], merged: bool = False
                       ) -> tuple[tuple[int, ...], list[torch.Tensor], Sequence[torch.Tensor],
                                  tuple[int, ...], int, int, bool]:
    """Run-time sizes of the input space with the kept dims first and the reduced
    dims last, the outputs (the root's first), the inputs as passed, their strides in launch order
    (kinds/reduction.py: stride_params), the numbers of outputs and of reduced
    elements per output, and whether the first prologue input is laid out with
    the reduction innermost (the Triton launcher's tile shape follows it).
    The geometry is computed once per combination of input sizes and strides
    (launch.cached_geometry)."""
    g = cached_geometry(spec, inputs, _reduction_geometry)
    device = inputs[0].device if inputs else torch.device("cpu")
    outs = [empty_strided(g.out_shape, g.out_stride, dtype, device) for dtype in out_dtypes]
    tensors = inputs if g.direct else [x.contiguous() if flat else x
                                       for x, flat in zip(inputs, g.flat, strict=True)]
    space = g.merged_space if merged else g.space
    return space, outs, tensors, g.strides, g.n_out, g.n_red, g.inner


def _reduction_geometry(spec: KernelSpec, inputs: tuple[torch.Tensor, ...]
                        ) -> _ReductionGeometry:
    meta = spec.meta
    dims, kept = meta["dims"], meta["kept"]
    shape = broadcast_sizes([x.shape for x, p in zip(inputs, meta["phases"], strict=True)
                             if "in" in p])
    shape = [1] * (spec.rank - len(shape)) + shape
    space = tuple(shape[k] for k in kept + list(dims))
    out_shape = [1 if k in dims else shape[k] for k in range(spec.rank)] if meta["keepdim"] \
        else [shape[k] for k in kept]
    flags: list[bool] = []
    strides: list[int] = []
    starts: list[int] = []  # where each strided prologue input's strides begin
    inner = None
    for i, x in enumerate(inputs):
        phases = meta["phases"][i]
        if inner is None and "in" in phases:
            st = x.expand(shape).stride()
            inner = not kept or abs(st[dims[-1]]) <= abs(st[kept[-1]])
        flags.append(all(meta["in_flat"][i] if p == "in" else meta["out_flat"][i]
                         for p in phases))
        if "in" in phases and not meta["in_flat"][i]:
            st = x.expand(shape).stride()
            starts.append(len(strides))
            strides.extend(st[k] for k in kept + list(dims))
        if "out" in phases and not meta["out_flat"][i]:
            st = x.expand(out_shape).stride()
            strides.extend([st[k] for k in kept] if meta["keepdim"] else st)
    direct = all(not f or x.is_contiguous() for x, f in zip(inputs, flags, strict=True))
    merged = list(space)
    merge_inner(merged, strides, starts, spec.rank - len(dims))
    return _ReductionGeometry(space, tuple(out_shape), dense_strides(out_shape), tuple(flags),
                              tuple(strides),
                              _numel(tuple(shape[k] for k in kept)),
                              _numel(tuple(shape[k] for k in dims)), inner is not False, direct,
                              tuple(merged))

