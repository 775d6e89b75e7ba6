"""Replaying a compiled inference graph as one CUDA graph (`Options.cudagraphs`).

A compiled graph launches each kernel and library call from Python, tens of
microseconds apiece; when the kernels are short the GPU waits on Python. A CUDA
graph records every launch once and replays them with one call.

The runner keeps results exactly as without it:
- only inference graphs whose arguments are all CUDA tensors, with no input
  mutation, no random ops and no output aliasing an input or another output
  (`eligible`, decided at compile time);
- one entry per combination of argument sizes, strides and dtypes, recorded at
  the second call (the first compiles the kernels), at most `MAX_GRAPHS`;
- a graph reads its arguments either where the caller's tensors are (recorded
  when the second call passed the very tensors of the first, e.g. an input
  buffer refilled in place; replayed only on those same tensors), or from its
  own buffers, into which each call copies them; parameters are always read in
  place, and a different parameter tensor means the plain wrapper;
- results are new tensors over the graph's own output memory, not copies: a
  graph is replayed only while no tensor over its previous results' memory is
  alive (their storages' use counts, `_Slot.free`). A loop `y = f(x)` still
  holds the last result while the next call runs, so an entry records up to
  `SLOTS` graphs and alternates between them; when every one is busy, the call
  runs the plain wrapper;
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
# Graphs recorded per entry (see the module docstring): two serve a loop `y = f(x)`.
SLOTS = 2
# Under `auto`, graphs with fewer launches run plainly. Measured on an H200: the
# fp16 GPT-2 block (about 30 launches) ran 0.64 ms replayed against 0.72 ms, while
# one-kernel graphs (a 8192x4096 layer_norm) ran 0.125 ms replayed against 0.072:
# the input copy and output clone cost more than one launch. (Choosing by timing
# both at capture proved unreliable: it picked replay for those.) Since replays
# copy nothing in a steady loop, such graphs time the same either way (H100,
# do_bench: layer_norm_4k 0.102 ms plainly, 0.103 replayed; softmax_1k 0.0945 and
# 0.0942), so replaying them would only hold a second copy of their memory.
AUTO_MIN_LAUNCHES = 12
# Graphs without matrix products wait on Python from 3 launches: conv+bn+relu (a
# copy kernel, the conv, the epilogue) ran 0.101 ms replayed against 0.112, the
# ResNet block (5 launches) 0.167 against 0.217 (H200). With products the GPU is
# busy long enough: the fp16 MLP (cuBLAS, gelu, cuBLAS) lost, 0.257 against 0.241.
# Without the copies (H100): conv+bn+relu 0.084 ms replayed against 0.104 plainly
# (Inductor 0.088-0.157), the ResNet block 0.160 against 0.190 (Inductor 0.202-0.206).
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


def _uses(t: torch.Tensor) -> int:
    """How many tensors hold `t`'s storage (the check's own reference included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class _Slot:
    """One recorded graph of an entry."""

    replay: Callable[[], Any]
    reads: tuple[int, ...]  # the address of each argument the graph reads
    # per argument, the buffer each call copies it into (a parameter: itself); None
    # when the graph reads the caller's tensors, replayed only on tensors at `reads`
    buffers: list[torch.Tensor] | None
    outputs: Sequence[Any]  # the graph's results (tensors over its own memory)
    tensors: list[torch.Tensor]  # those of them that are tensors
    addresses: list[int]  # each tensor's address when recorded
    # each result's storage use count when recorded, before any result was handed out.
    # Exactly equal, not at most: a reference of the recording's that went away since
    # could otherwise hide one of the caller's (the graph then runs plainly, never
    # over a result still held)
    uses: list[int]

    def free(self) -> bool:
        """No tensor over the previous results' memory is alive (and no result's
        storage was resized away from the graph's memory)."""
        return all(o.data_ptr() == a and _uses(o) == u for o, a, u in
                   zip(self.tensors, self.addresses, self.uses, strict=True))

    def results(self) -> Any:
        """New tensors over the results' memory, in the wrapper's container type."""
        kind: Any = type(self.outputs)  # a list or a tuple
        return kind(o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs)


@dataclass
class _Entry:
    params: list[torch.Tensor]  # parameter arguments, read in place
    versions: list[int]  # their version counters when the first graph was recorded
    slots: list[_Slot]


def _addresses(args: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(a.data_ptr() for a in args)


class CudaGraphRunner:
    """A boxed callable (takes a list of arguments) around the plain wrapper `fn`."""

    def __init__(self, fn: Callable[[list[Any]], Any], params: Sequence[bool], mode: str,
                 log: Callable[[str], None] | None = None) -> None:
        self.fn = fn
        self.params = list(params)
        self.mode = mode  # "auto" or "on"
        self.log = log or (lambda line: None)
        self.seen: dict[Any, tuple[int, ...]] = {}  # per key, the last plain call's addresses
        self.graphs: dict[Any, _Entry] = {}
        self.disabled: str | None = None
        self.plain = 0  # calls that found every slot busy (tests read it)
        self._boxed_call = True

    @staticmethod
    def _accepts(args: list[Any]) -> bool:
        return all(isinstance(a, torch.Tensor) and a.is_cuda for a in args)

    def _is_param(self, i: int) -> bool:
        return i < len(self.params) and self.params[i]

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled is not None or not args:
            return self.fn(args)
        if not self._accepts(args):
            return self.fn(args)
        key = tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or len(self.graphs) >= MAX_GRAPHS:
                self.seen[key] = _addresses(args)
                return self.fn(args)
            params = [a for i, a in enumerate(args) if self._is_param(i)]
            entry = self.graphs[key] = _Entry(params, [p._version for p in params], [])
        elif any(a._version != v for a, v in zip(entry.params, entry.versions, strict=True)):
            # a parameter changed in place: constants folded from it (frontend/fold.py)
            # may be stale inside the graphs, so record them again
            del self.graphs[key]
            self.seen[key] = _addresses(args)
            return self.fn(args)
        slot = self._pick(entry, args)
        if slot is None:
            if len(entry.slots) >= SLOTS:
                self.plain += 1
                return self.fn(args)
            try:
                slot = self._capture(args, direct=self.seen.get(key) == _addresses(args))
            except Exception as e:  # noqa: BLE001 - no graph: the plain wrapper stays
                self.disabled = f"capture failed: {type(e).__name__}: {e}"
                self.log(f"CUDA graph off: {self.disabled}")
                torch.cuda.synchronize()
                return self.fn(args)
            entry.slots.append(slot)
        if slot.buffers is not None:
            for buf, a in zip(slot.buffers, args, strict=True):
                if buf.data_ptr() != a.data_ptr():
                    buf.copy_(a)
        slot.replay()
        return slot.results()

    def _pick(self, entry: _Entry, args: list[torch.Tensor]) -> _Slot | None:
        """A free slot that can take `args`: one reading them where they are first,
        else one with its own buffers (not when a parameter tensor differs)."""
        copying = None
        for slot in entry.slots:
            if not slot.free():
                continue
            same = [r == a.data_ptr() for r, a in zip(slot.reads, args, strict=True)]
            if all(same):
                return slot
            if slot.buffers is not None and all(ok for i, ok in enumerate(same)
                                                if self._is_param(i)):
                copying = copying or slot
        return copying

    def _capture(self, args: list[torch.Tensor], direct: bool) -> _Slot:
        inputs = [a if direct or self._is_param(i) else a.clone() for i, a in enumerate(args)]
        replay, outputs = self._record(inputs)
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        storages = {o.untyped_storage().data_ptr() for o in tensors}
        if len(storages) < len(tensors) or storages & {i.untyped_storage().data_ptr()
                                                         for i in inputs}:
            raise RuntimeError("outputs share memory with each other or with inputs")
        slot = _Slot(replay, _addresses(inputs), None if direct else inputs, outputs, tensors,
                     [o.data_ptr() for o in tensors], [_uses(o) for o in tensors])
        where = "the caller's tensors" if direct else "its own input buffers"
        self.log(f"CUDA graph recorded for {len(args)} argument(s), reading {where}: "
                 "replayed from now on")
        return slot

    def _record(self, inputs: list[torch.Tensor]) -> tuple[Callable[[], Any], Sequence[Any]]:
        """Record `fn` on `inputs` as a CUDA graph: its replay and its outputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(inputs)  # allocations and library handles made outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(inputs)
        return graph.replay, outputs
