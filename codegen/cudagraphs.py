"""Replaying a compiled inference graph as one CUDA graph (`Options.cudagraphs`).

A compiled graph launches each kernel and library call from Python, tens of
microseconds apiece; when the kernels are short the GPU waits on Python. A CUDA
graph records every launch once and replays them with one call.

The runner keeps results exactly as without it:
- only inference graphs whose arguments are all CUDA tensors, with no input
  mutation, no random ops and no output aliasing an input or another output
  (`eligible`, decided at compile time);
- one graph per combination of argument sizes, strides and dtypes, captured at
  the second call (the first compiles the kernels), at most `MAX_GRAPHS`;
- each call copies its arguments into the graph's own input buffers, except
  parameters that are the very tensors seen at capture, and returns clones of
  the graph's outputs, so no result is overwritten by a later call;
- under `auto`, only graphs of at least AUTO_MIN_LAUNCHES kernel launches and
  ATen calls (AUTO_MIN_LAUNCHES_NO_MATMUL without matrix products) are replayed;
  any capture error means the plain wrapper from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_GRAPHS = 8
# Under `auto`, graphs with fewer launches run plainly. Measured on an H200: the
# fp16 GPT-2 block (about 30 launches) ran 0.64 ms replayed against 0.72 ms, while
# one-kernel graphs (a 8192x4096 layer_norm) ran 0.125 ms replayed against 0.072:
# the input copy and output clone cost more than one launch. (Choosing by timing
# both at capture proved unreliable: it picked replay for those.)
AUTO_MIN_LAUNCHES = 12
# Graphs without matrix products wait on Python from 3 launches: conv+bn+relu (a
# copy kernel, the conv, the epilogue) ran 0.101 ms replayed against 0.112, the
# ResNet block (5 launches) 0.167 against 0.217 (H200). With products the GPU is
# busy long enough: the fp16 MLP (cuBLAS, gelu, cuBLAS) lost, 0.257 against 0.241.
AUTO_MIN_LAUNCHES_NO_MATMUL = 3
MATMUL_OPS = ("mm", "addmm", "bmm")
MATMUL_TEMPLATES = ("triton/matmul", "triton/attention")


def auto_declines(aten_ops: dict[str, int], kernels: list[dict[str, Any]]) -> str | None:
    """Under `auto`: why a graph of these ATen calls and kernels is not replayed."""
    launches = sum(aten_ops.values()) + len(kernels)
    products = any(aten_ops.get(op) for op in MATMUL_OPS) or any(
        k.get("template") in MATMUL_TEMPLATES for k in kernels)
    least = AUTO_MIN_LAUNCHES if products else AUTO_MIN_LAUNCHES_NO_MATMUL
    if launches < least:
        kind = "with" if products else "without"
        return f"{launches} launch(es) {kind} matrix products, fewer than {least} (auto)"
    return None


# FX targets that make a graph ineligible: results would differ between replays
# (random numbers) or land in the graph's buffers instead of the caller's tensors.
UNSAFE = ("copy_", "rand", "bernoulli", "dropout", "normal", "uniform", "exponential",
          "multinomial", "set_", "resize_")


def eligible(gm: torch.fx.GraphModule, kind: str, aliased_outputs: bool) -> str | None:
    """None when the graph may be replayed; else why not."""
    if kind != "inference":
        return f"a {kind} graph (only inference graphs are replayed)"
    if aliased_outputs:
        return "an output aliases an input"
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            schema = getattr(node.target, "_schema", None)
            if any(u in name for u in UNSAFE) or (schema is not None and schema.is_mutable):
                return f"it calls {name}"
    return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Sequence[Any]
    params: list[torch.Tensor]  # parameter arguments, used in place
    versions: list[int]  # their version counters at capture
    use: bool = True


def _clones(outputs: Sequence[Any]) -> Any:
    """Fresh copies of the graph's outputs, in the wrapper's container type."""
    kind: Any = type(outputs)  # a list or a tuple
    return kind(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)


class CudaGraphRunner:
    """A boxed callable (takes a list of arguments) around the plain wrapper `fn`."""

    def __init__(self, fn: Callable[[list[Any]], Any], params: Sequence[bool], mode: str,
                 log: Callable[[str], None] | None = None) -> None:
        self.fn = fn
        self.params = list(params)
        self.mode = mode  # "auto" or "on"
        self.log = log or (lambda line: None)
        self.seen: dict[Any, int] = {}
        self.graphs: dict[Any, _Captured] = {}
        self.disabled: str | None = None
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled is not None or not args:
            return self.fn(args)
        if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return self.fn(args)
        key = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2 or len(self.graphs) >= MAX_GRAPHS:
                return self.fn(args)
            try:
                entry = self._capture(args)
            except Exception as e:  # noqa: BLE001 - no graph: the plain wrapper stays
                self.disabled = f"capture failed: {type(e).__name__}: {e}"
                self.log(f"CUDA graph off: {self.disabled}")
                torch.cuda.synchronize()
                return self.fn(args)
            self.graphs[key] = entry
        if not entry.use:
            return self.fn(args)
        if any(a._version != v for a, v in zip(entry.params, entry.versions, strict=True)):
            # a parameter changed in place: constants folded from it (frontend/fold.py)
            # may be stale inside the graph, so record it again
            del self.graphs[key]
            self.seen[key] = 1
            return self.fn(args)
        for i, (buf, a) in enumerate(zip(entry.inputs, args, strict=True)):
            if buf.data_ptr() != a.data_ptr():
                if i < len(self.params) and self.params[i]:
                    return self.fn(args)  # a different parameter tensor: never write into it
                buf.copy_(a)
        entry.graph.replay()
        return _clones(entry.outputs)

    def _capture(self, args: list[torch.Tensor]) -> _Captured:
        inputs = [a if i < len(self.params) and self.params[i] else a.clone()
                  for i, a in enumerate(args)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(inputs)  # allocations and library handles made outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(inputs)
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        storages = {o.untyped_storage().data_ptr() for o in tensors}
        if len(storages) < len(tensors) or storages & {i.untyped_storage().data_ptr()
                                                         for i in inputs}:
            raise RuntimeError("outputs share memory with each other or with inputs")
        params = [a for i, a in enumerate(args) if i < len(self.params) and self.params[i]]
        entry = _Captured(graph, inputs, outputs, params, [p._version for p in params])
        self.log(f"CUDA graph recorded for {len(args)} argument(s): replayed from now on")
        return entry
