"""Autotuning (mode="max-autotune"): a Triton kernel's launch configuration timed,
the fastest kept on disk.

Without it every launch uses the launcher's fixed heuristic (runtime/launch.py,
runtime/matmul_launch.py: `choose_tile`, runtime/reduction_launch.py). Under
`mode="max-autotune"` (or "max-autotune-no-cudagraphs") runtime/prepare.py sets
`KernelSpec.autotune`, and `KernelRecipe.build` wraps the kernel in a
`TunedKernel`. The launcher still computes and makes its heuristic launch; the
wrapper sees that launch and, for a call it has not seen (its arguments' sizes,
strides and dtypes, and the heuristic's constexprs), tries each configuration of
the kernel's kind's tuning space (`KernelSpec.tuning`, kinds/tuning.py):

- pointwise: BLOCK_SIZE 256..4096 x num_warps 2, 4, 8;
- tiled pointwise (layout changes): BLOCK_Y x BLOCK_X 32..128 x num_warps 4, 8;
- row (softmax, layer_norm...): num_warps within 4x of the heuristic's, and for
  looped rows (kinds/row_looped.py) num_stages 1-3;
- matmul: about ten tiles for the dtype (block m/n/k, warps, stages);
- reduction: num_warps of the main kernel (its block sizes set the split, so
  they stay the heuristic's).

Attention kernels and the reduction's combine kernel are not tuned.

The heuristic's own launch is always the first candidate and wins ties, so
autotuning never keeps a configuration that measured slower than it. Each
candidate runs on the real inputs and writes the launch's own outputs, which the
winner's launch then writes again; one that fails to compile or launch is
skipped. On CUDA a candidate is timed with CUDA events after a warm-up launch,
L2 flushed before each run, the median of up to MAX_REPS runs (as
triton.testing.do_bench does); on the CPU (Triton's interpreter) it is one run
under perf_counter after a warm-up run, and at most CANDIDATE_LIMIT candidates
besides the heuristic are tried, so that the mechanism runs in the test suite.

The winner is stored signed (runtime/disk_cache.py) in
`$REWRITEC_CACHE_DIR/autotune/`, keyed as the kernel binaries are
(runtime/static_launch.py: `Binaries._key`): the kernel's source and symbol, the
call, the device's compute capability and the Triton fingerprint. A later
launcher, in this process or another, reads it and times nothing. A stored
winner that is damaged, not signed with this user's key, or not among the
current candidates is ignored. Anything odd (no measurement, a CUDA graph being
captured, more than LIMIT calls) means the heuristic's launch, as in mode
default, which pays nothing for this module: its kernels are not wrapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..engine.diag import log
from ..kinds.spec import KernelSpec
from ..kinds.tuning import DEFAULT_WARPS, Config, space
from .disk_cache import read_verified, store, subdir
from .static_launch import _fingerprint
from .triton_direct import POISON

FORMAT = 1  # bump when the candidates' meaning or the stored layout changes
LIMIT = 64  # calls tuned per kernel; beyond (shapes that change every call) the heuristic
CANDIDATE_LIMIT = 3  # under Triton's interpreter: candidates tried besides the heuristic
MAX_REPS = 100  # timed runs a candidate at most on CUDA ...
MIN_REPS = 5  # ... and at least
TIME_BUDGET_MS = 25.0  # ... aiming at about this much GPU time a candidate
L2_FLUSH_BYTES = 256 << 20  # written before each timed run, so no run finds its inputs in L2
# Triton's launch defaults, for telling a candidate from the heuristic's launch.
DEFAULTS = {"num_warps": DEFAULT_WARPS, "num_stages": 3}

# What this process did, for tests and REWRITEC_DEBUG: calls tuned (timed), and
# winners read from disk.
STATS = {"tuned": 0, "timed": 0, "read": 0}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------- the spaces


def space_name(spec: KernelSpec) -> str | None:
    """The name of the space a spec's main kernel is tuned in (its kind's,
    kinds/tuning.py); None: not tuned (attention)."""
    return spec.tuning


def candidates(spec: KernelSpec, kwargs: dict[str, Any]) -> list[Config]:
    """The heuristic's launch ({}) first, then the space's other configurations
    (under the interpreter, CANDIDATE_LIMIT of them, spread over the list)."""
    tuning = space(spec.tuning)
    if tuning is None:
        return [{}]
    others = [c for c in tuning.configs(spec, kwargs) if not _is_heuristic(c, kwargs)]
    if interpreted() and len(others) > CANDIDATE_LIMIT:
        step = len(others) / CANDIDATE_LIMIT
        others = [others[int(i * step)] for i in range(CANDIDATE_LIMIT)]
    return [{}, *others]


def _is_heuristic(config: Config, kwargs: dict[str, Any]) -> bool:
    return all(kwargs.get(k, DEFAULTS.get(k)) == v for k, v in config.items())


# --------------------------------------------------------------------------- the kernel


class TunedKernel:
    """Used like the kernel it wraps (`kernel[grid](*args, **kwargs)`, with the
    heuristic's grid and constexprs): launches each call with its winner."""

    def __init__(self, inner: Any, spec: KernelSpec, source: str, symbol: str) -> None:
        self.inner = inner
        self.spec = spec
        self.space = space(spec.tuning)
        self.kernel = hashlib.sha256(f"{symbol}\0{source}".encode()).hexdigest()
        self.chosen: dict[Any, Config] = {}  # call -> winner
        self.timings: dict[Any, list[tuple[float, Config]]] = {}  # call -> what was measured

    def __getattr__(self, name: str) -> Any:  # the wrapped kernel's counters and options
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # runtime/launch.py: Launcher._learn watches the kernel's launches to learn a
    # plan; the wrapped kernel makes them, so it is the one watched. A tuning launch
    # records every candidate's (so no plan is learned), a later one the winner's.
    @property
    def watch(self) -> Any:
        return getattr(self.inner, "watch", None)

    @watch.setter
    def watch(self, seen: Any) -> None:
        self.inner.watch = seen

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            return self.launch(grid, args, kwargs)

        return launch

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        call = _call(args, kwargs)
        config = self.chosen.get(call)
        if config is None:
            config = self._choose(call, grid, args, kwargs)
        if not config or self.space is None:
            return self.inner[grid](*args, **kwargs)
        return self.inner[self.space.grid(self.spec, config, args, grid)](
            *args, **{**kwargs, **config})

    def _choose(self, call: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Config:
        """The call's winner: stored, or timed now (and stored). {} (the heuristic's
        launch) where it cannot be timed: not remembered, so that a call first seen
        inside a CUDA graph capture is tuned at its next eager launch."""
        device = _device(args)
        if device is not None and device.type == "meta":
            # runtime/ahead.py predicting a first launch on meta tensors: its swap
            # of DirectKernels for recorders does not see inside this wrapper, so
            # the launch must not reach the kernel; the JIT compiles at launch
            raise NotImplementedError("an autotuned kernel's launch is not predicted")
        if self.space is None or device is None or len(self.chosen) >= LIMIT:
            return {}
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return {}  # no timing inside a capture; the next eager launch tunes
        configs = candidates(self.spec, kwargs)
        try:
            path = _root() / f"{self._key(args, kwargs, device)}.json"
        except Exception as e:  # noqa: BLE001 - no cache folder: tune, keep in memory only
            log.info("autotune %s: winners not stored: %s: %s", self.spec.name,
                     type(e).__name__, e)
            path = None
        stored = _read(path, configs) if path is not None else None
        if stored is not None:
            STATS["read"] += 1
            self.chosen[call] = stored
            return stored
        # timing launches every candidate: none of them is a plan to replay
        # (runtime/launch.py: Launcher._learn), so the watcher is told
        seen = self.inner.watch
        if seen is not None:
            seen.append(POISON)
        winner = self._tune(call, grid, args, kwargs, configs, device)
        self.chosen[call] = winner
        if path is not None and call in self.timings:
            _write(path, winner, self.timings[call])
        return winner

    def _tune(self, call: Any, grid: tuple[int, ...], args: tuple[Any, ...],
              kwargs: dict[str, Any], configs: list[Config], device: torch.device) -> Config:
        assert self.space is not None
        runners = getattr(self.inner, "runners", None)
        before = set(runners) if isinstance(runners, dict) else None
        measured: list[tuple[float, Config]] = []
        try:
            for config in configs:
                g = self.space.grid(self.spec, config, args, grid) if config else grid
                kw = {**kwargs, **config}

                def run(g: tuple[int, ...] = g, kw: dict[str, Any] = kw) -> None:
                    self.inner[g](*args, **kw)

                try:
                    measured.append((measure(run, device), config))
                except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped
                    log.info("autotune %s: %r skipped: %s: %s", self.spec.name, config,
                             type(e).__name__, e)
        finally:
            if before is not None and runners is not None:
                for key in set(runners) - before:  # the losers' launchers need no slot
                    del runners[key]
        STATS["tuned"] += 1
        STATS["timed"] += len(measured)
        if not measured or measured[0][1] != {}:
            return {}  # the heuristic's launch failed: the launcher's fallback decides
        best = min(measured, key=lambda m: m[0])  # the first (the heuristic) of equals
        self.timings[call] = measured
        log.info("autotune %s (rule %s): %r wins, %.4g ms against the heuristic's %.4g ms "
                 "(%d candidates)", self.spec.name, self.spec.rule, best[1] or "heuristic",
                 best[0], measured[0][0], len(measured))
        return best[1]

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> str:
        """As runtime/static_launch.py's Binaries._key: kernel, device capability,
        Triton's fingerprint, and the call (sizes, strides and dtypes)."""
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            capability = f"cuda {major}.{minor}"
        else:
            capability = device.type
        text = (f"autotune {FORMAT}\n{self.kernel}\n{capability}\n{_fingerprint()}\n"
                f"{_call(args, kwargs, stored=True)!r}")
        return hashlib.sha256(text.encode()).hexdigest()[:40]


def tuned(kernel: Any, spec: KernelSpec, source: str) -> Any:
    """`kernel` (the spec's main kernel, symbol `spec.symbol`) wrapped to launch its
    calls' winners; as it is where the spec's kind is not tuned."""
    return kernel if spec.tuning is None else TunedKernel(kernel, spec, source, spec.symbol)


def _call(args: tuple[Any, ...], kwargs: dict[str, Any], stored: bool = False
          ) -> tuple[Any, ...]:
    """What a winner is found by: each tensor's dtype, sizes, strides and device
    (its type where `stored`), every other argument, and the heuristic's kwargs."""
    tensor = torch.Tensor
    return (tuple(kwargs.items()), tuple([
        a if type(a) is int else
        (a.dtype, tuple(a.shape), a.stride(), a.device.type if stored else a.device)
        if isinstance(a, tensor) else (type(a).__name__, a) for a in args]))


def _device(args: tuple[Any, ...]) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


# --------------------------------------------------------------------------- timing


def measure(run: Callable[[], None], device: torch.device) -> float:
    """Milliseconds one `run` takes: on CUDA the median of event-timed runs after
    a warm-up (which compiles, and fails for a candidate that cannot run); elsewhere
    (Triton's interpreter) the second of two runs under perf_counter (the first
    pays the interpreter's one-time costs, which would count against the heuristic)."""
    if device.type != "cuda":
        run()
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    run()
    torch.cuda.synchronize(device)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    run()
    last.record()
    torch.cuda.synchronize(device)
    estimate = max(first.elapsed_time(last), 1e-3)
    reps = max(MIN_REPS, min(MAX_REPS, int(TIME_BUDGET_MS / estimate)))
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start_event, end_event in events:
        flush.zero_()
        start_event.record()
        run()
        end_event.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


# --------------------------------------------------------------------------- the store


def _root() -> Path:
    return subdir("autotune")


def _read(path: Path, configs: list[Config]) -> Config | None:
    """The stored winner, if it is signed by this user and among `configs`."""
    data = read_verified(path)
    if data is None:
        return None
    try:
        config = json.loads(data)["config"]
    except (ValueError, KeyError, TypeError):
        return None
    return config if config in configs else None


def _write(path: Path, winner: Config, measured: list[tuple[float, Config]]) -> None:
    record = {"config": winner, "measured_ms": [[ms, c] for ms, c in measured]}
    try:
        store(path, json.dumps(record).encode())
    except OSError as e:  # a full disk: the winner holds for this process only
        log.info("autotune: winner not stored: %s", e)
