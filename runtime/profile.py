"""Time per kernel: what a compiled graph's calls measure with the `profile` option.

A profiled graph gets a wrapper of its own (runtime/wrapper.py: lower with a
`GraphProfile`): each kernel launch and each ATen call is bracketed by
`_start()` and `_stop(slot, token)`, and so is the whole call (slot 0). A
graph without the option is lowered exactly as before, so profiling costs
nothing when off.

Two timers, chosen once per graph from the device its tensors live on:
- `perf_counter` (the CPU): OpenMP kernels and CPU ATen calls are synchronous,
  so the wall time around a call is its time.
- `cuda_events` (CUDA): an event recorded on the current stream before and
  after the launch; the time between them is resolved later, in batches, so a
  launch does not wait for the GPU. It includes any gap in which the GPU waited
  for the host to launch the next kernel.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

Timer = Literal["perf_counter", "cuda_events"]
SlotKind = Literal["graph", "kernel", "aten"]
# Samples kept per slot for the median: the latest ones, so that a first call
# that compiled a kernel (Triton's JIT) leaves the median once calls go on
SAMPLES = 1024
# CUDA events waiting to be read: past this, the oldest are resolved (a wait on
# the GPU only as long as it still runs them)
PENDING_EVENTS = 4096


@dataclass(frozen=True)
class Slot:
    """One timed line of a wrapper: the whole call, a kernel launch or an ATen call.
    `name` is the kernel's name (report.json's kernels[].name) or the op's label
    (as in fallback_ops); `node` the term's id in the graph's details file."""

    kind: SlotKind
    name: str
    node: int | None = None


class GraphProfile:
    """Calls, total seconds and recent samples per slot of one graph's wrapper."""

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.slots: list[Slot] = []
        self.counts: list[int] = []
        self.totals: list[float] = []
        self.samples: list[deque[float]] = []
        self.first: list[float | None] = []  # the first call's time: lazy loads, JIT
        self._pending: list[tuple[int, Any, Any]] = []
        self._free: list[Any] = []
        self.slot(Slot("graph", "call"))  # slot 0: the whole call

    def slot(self, slot: Slot) -> int:
        self.slots.append(slot)
        self.counts.append(0)
        self.totals.append(0.0)
        self.samples.append(deque(maxlen=SAMPLES))
        self.first.append(None)
        return len(self.slots) - 1

    def functions(self) -> tuple[Any, Any]:
        """(`_start`, `_stop`) as the profiled wrapper calls them."""
        if self.timer == "cuda_events":
            return self._event_start, self._event_stop
        return time.perf_counter, self._lap

    def _add(self, i: int, seconds: float) -> None:
        if not self.counts[i]:
            self.first[i] = seconds
        self.counts[i] += 1
        self.totals[i] += seconds
        self.samples[i].append(seconds)

    def _lap(self, i: int, start: float) -> None:
        self._add(i, time.perf_counter() - start)

    def _event(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _event_start(self) -> Any:
        return self._event()

    def _event_stop(self, i: int, start: Any) -> None:
        self._pending.append((i, start, self._event()))
        if len(self._pending) > PENDING_EVENTS:
            self.resolve(len(self._pending) // 2)

    def resolve(self, n: int | None = None) -> None:
        """Read the first `n` pending event pairs (all by default), waiting for the
        GPU to reach the last of them."""
        todo = self._pending if n is None else self._pending[:n]
        if not todo:
            return
        todo[-1][2].synchronize()
        for i, start, end in todo:
            self._add(i, start.elapsed_time(end) / 1000.0)
            self._free += (start, end)
        del self._pending[:len(todo)]

    def to_json(self) -> dict[str, Any]:
        """report.json's `profile` of the graph (docs/report.md)."""
        self.resolve()
        by_kind: dict[str, dict[str, list[int]]] = {"kernel": {}, "aten": {}}
        for i, s in enumerate(self.slots):
            if s.kind != "graph":
                by_kind[s.kind].setdefault(s.name, []).append(i)
        measured = sum(self.totals[1:])
        entries = {kind: {name: self._stats(ix, measured) for name, ix in names.items()}
                   for kind, names in by_kind.items()}
        return {
            "timer": self.timer,
            "calls": self.counts[0],
            "total_s": self.totals[0],
            "median_s": _median(self.samples[0]),
            "first_s": self.first[0],
            "measured_s": measured,
            "kernels": _by_time(entries["kernel"]),
            "aten": _by_time(entries["aten"]),
            "nodes": {str(s.node): {"op": s.name, **self._stats([i], measured)}
                      for i, s in enumerate(self.slots) if s.kind == "aten"},
        }

    def _stats(self, ix: list[int], measured: float) -> dict[str, Any]:
        """calls, total, mean and median seconds, the first call's seconds and the
        share of the graph's measured time, of the slots `ix` together (an ATen op
        called on several lines: their calls pooled, the median over every line's
        recent samples, the first calls summed)."""
        calls = sum(self.counts[i] for i in ix)
        total = sum(self.totals[i] for i in ix)
        samples = [x for i in ix for x in self.samples[i]]
        firsts = [self.first[i] for i in ix if self.first[i] is not None]
        return {"calls": calls, "total_s": total, "mean_s": total / calls if calls else None,
                "median_s": _median(samples), "first_s": sum(firsts) if firsts else None,
                "share": round(total / measured, 4) if measured else None}


def _median(samples: Any) -> float | None:
    return statistics.median(samples) if samples else None


def _by_time(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Largest total first (JSON objects keep their order)."""
    return dict(sorted(entries.items(), key=lambda kv: -kv[1]["total_s"]))


def timer_for(devices: set[str]) -> Timer:
    """CUDA events where any of the graph's tensors is on a CUDA device."""
    return "cuda_events" if any(d.startswith("cuda") for d in devices) else "perf_counter"
