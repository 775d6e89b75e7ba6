"""Benchmark harness: eager PyTorch vs Inductor vs rewritec, measured in one process.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--cases a,b]
    python -m benchmarks.run --suite models [options of benchmarks.models]

For every case (see `benchmarks.cases`) the same process measures eager PyTorch,
`torch.compile(fn)` (Inductor, default mode) and `torch.compile(fn, backend="rewritec")`,
checks rewritec's (and Inductor's) output against eager, and reports median times:

* CUDA: `triton.testing.do_bench` (median), else CUDA events;
* CPU: `time.perf_counter` after warmup, median over repeats of a calibrated inner loop.

Memory-bound cases also report achieved GB/s (minimal bytes read + written / time) and
the percentage of the device's copy bandwidth, measured once per run with a large
`dst.copy_(src)`.

Cold compile time (first call, fresh caches) is measured in a fresh subprocess,
`python -m benchmarks.run --compile-probe CASE --backend X`, with new temporary
TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and REWRITEC_CACHE_DIR; warm compile time
is a second fresh subprocess reusing those cache dirs. Before the timed first call,
each probe starts TorchDynamo on a trivial function with its `eager` backend
(`start_dynamo`): that one-time start-up is common to every backend, and what
is timed is the backend's own tracing, compiling and kernel building.

Output: one markdown table (printed, and written to `benchmarks/results/<device>.md`)
plus the raw numbers as JSON beside it. Failures never stop the run: an error is
recorded in its row, a wrong result marks the row MISMATCH. Nothing here asserts on
timings.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fnmatch
import gc
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cases import BY_NAME, CASES, Case, Config, Instance, Skip

BACKENDS = ("inductor", "rewritec")
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PROBE_MARKER = "REWRITEC_BENCH_PROBE "
# Cases whose cold/warm compile is probed in --quick mode (each pair of probes is skipped
# when the time budget cannot cover it).
QUICK_PROBE_CASES = ("pointwise_chain", "layer_norm_4k")
# --suite: this module's cases, or the real models of benchmarks.models
SUITES = ("cases", "models")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Limits:
    """Repeat counts and time limits; --quick shrinks them."""

    warmup: int
    repeats: int
    measure_s: float  # CPU: stop repeating after this long (at least 3 samples)
    min_sample_s: float  # CPU: inner loop long enough for one sample to be this long
    compile_s: float  # in-process compile + first call, per backend
    probe_s: float  # one compile-probe subprocess
    budget_s: float | None  # whole run (soft: checked between steps)
    probe_reserve_s: float  # budget kept back for the compile probes
    probe_repeats: int  # cold + warm probe pairs per case and backend (median reported)
    cuda_warmup_ms: int
    cuda_rep_ms: int

    @staticmethod
    def make(quick: bool, budget_s: float | None, repeats: int | None,
             cuda: bool = False) -> Limits:
        if quick:
            # The 3-minute promise is the 2-core CPU's. On a GPU host every case runs
            # at full size, and on an H200 one probe pair (cold + warm) took 49 s for
            # Inductor and 27 s for rewritec: the last Inductor probe ran out of a
            # 170 s budget. One H100 probe's cold compile swung from 0.47 to 0.62 s
            # between two fresh processes, so a quick CUDA run takes the median of three
            # pairs per backend, interleaved; a pair of fresh processes takes about 25 s
            # for rewritec and 40 s for Inductor on an H100 host, so 390 s of 540 are
            # kept for the probes. The 2-core CPU keeps one pair, for its 3 minutes.
            default_budget, reserve, pairs = (540.0, 390.0, 3) if cuda else (170.0, 45.0, 1)
            return Limits(warmup=2, repeats=repeats or 7, measure_s=0.6, min_sample_s=0.005,
                          compile_s=90.0, probe_s=90.0,
                          budget_s=default_budget if budget_s is None else budget_s,
                          probe_reserve_s=reserve, probe_repeats=pairs,
                          cuda_warmup_ms=10, cuda_rep_ms=40)
        return Limits(warmup=3, repeats=repeats or 25, measure_s=5.0, min_sample_s=0.02,
                      compile_s=600.0, probe_s=600.0, budget_s=budget_s, probe_reserve_s=0.0,
                      probe_repeats=3,
                      cuda_warmup_ms=25, cuda_rep_ms=100)


class Budget:
    """A soft deadline for the whole run."""

    def __init__(self, seconds: float | None) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def remaining(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()


# --------------------------------------------------------------------------- timing


class TimeLimit(Exception):
    """An in-process step ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeLimit in the main thread after `seconds` (Unix; a no-op elsewhere).

    Only Python code is interrupted: a long call into C++ ends before the signal lands.
    """
    if not hasattr(signal, "setitimer") or seconds <= 0 or math.isinf(seconds):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeLimit(f"time limit of {seconds:.0f} s exceeded")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float | None = None  # None where the method reports only the median (do_bench)
    samples: int | None = None


class Timer:
    """Median time of one call of a zero-argument function, in milliseconds."""

    def __init__(self, device: torch.device, limits: Limits) -> None:
        self.device = device
        self.limits = limits
        self.method = self._pick_method()

    def _pick_method(self) -> str:
        if self.device.type != "cuda":
            return "perf_counter"
        try:
            import triton.testing  # noqa: F401
        except ImportError:
            return "cuda_events"
        return "triton.testing.do_bench"

    def __call__(self, fn: Callable[[], Any]) -> Timing:
        if self.method == "perf_counter":
            return self._cpu(fn)
        if self.method == "cuda_events":
            return self._cuda_events(fn)
        return self._do_bench(fn)

    def _cpu(self, fn: Callable[[], Any]) -> Timing:
        lim = self.limits
        for _ in range(lim.warmup):
            fn()
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        inner = max(1, int(lim.min_sample_s / max(one, 1e-9)))
        samples: list[float] = []
        deadline = time.perf_counter() + lim.measure_s
        while len(samples) < lim.repeats and (len(samples) < 3 or time.perf_counter() < deadline):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
        return Timing(statistics.median(samples) * 1e3, min(samples) * 1e3, len(samples))

    def _do_bench(self, fn: Callable[[], Any]) -> Timing:
        from triton.testing import do_bench

        lim = self.limits
        try:
            ms = do_bench(fn, warmup=lim.cuda_warmup_ms, rep=lim.cuda_rep_ms, return_mode="median")
        except TypeError:  # older triton: no return_mode
            ms = do_bench(fn, warmup=lim.cuda_warmup_ms, rep=lim.cuda_rep_ms, quantiles=[0.5])
        if isinstance(ms, list | tuple):
            ms = ms[0]
        return Timing(float(ms))

    def _cuda_events(self, fn: Callable[[], Any]) -> Timing:
        lim = self.limits
        for _ in range(lim.warmup):
            fn()
        torch.cuda.synchronize()
        times: list[float] = []
        for _ in range(max(lim.repeats, 10)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return Timing(statistics.median(times), min(times), len(times))


def copy_bandwidth(device: torch.device, timer: Timer, quick: bool) -> float:
    """Achieved GB/s of a large `dst.copy_(src)` (bytes read + written)."""
    numel = (64 << 20 if quick else 256 << 20) if device.type == "cuda" else \
        (16 << 20 if quick else 32 << 20)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src)).median_ms
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- environment


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True,
                             timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    if not model:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    model = model or platform.processor() or platform.machine()
    return f"{model} ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"


def environment(device: torch.device, timer: Timer) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    try:
        import rewritec

        rewritec_version = rewritec.__version__
    except Exception as e:  # noqa: BLE001 - report, don't crash
        rewritec_version = f"import failed: {type(e).__name__}: {e}"
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            commit = head.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")
    return {
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "rewritec": rewritec_version,
        "git_commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "timing": timer.method,
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg")
        else "n/a",
    }


class ForeignLoad:
    """How many cores other processes kept busy while this one measured (Linux only)."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(wall s, busy CPU s of the whole machine, CPU s of this process and children)."""
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            ticks = [int(x) for x in fields]
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # minus idle, iowait
        import resource

        hz = os.sysconf("SC_CLK_TCK")
        own = sum(getattr(resource.getrusage(who), f)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        return time.perf_counter(), busy / hz, own + ForeignLoad._live_children_ticks() / hz

    @staticmethod
    def _live_children_ticks() -> int:
        """CPU ticks of still-running descendants (e.g. Inductor's compile workers)."""
        stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, utime + stime)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
            except (OSError, ValueError, IndexError):
                continue
        total, frontier = 0, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            for pid, (ppid, ticks) in stats.items():
                if ppid == parent:
                    total += ticks
                    frontier.append(pid)
        return total

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        foreign = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, foreign / (end[0] - self.start[0]))


def busy_warning(device: torch.device, foreign_cores: float | None) -> str | None:
    """A warning for CPU runs when other processes competed for the cores."""
    if device.type != "cpu" or foreign_cores is None or foreign_cores < 0.25:
        return None
    return (f"other processes kept {foreign_cores:.1f} of {os.cpu_count()} cores busy on "
            f"average while the cases ran: CPU timings are unreliable (they stall torch's "
            f"{torch.get_num_threads()} threads; try --threads 1 or a quiet machine)")


# --------------------------------------------------------------------------- results


@dataclass
class BackendResult:
    ms: float | None = None  # median
    min_ms: float | None = None
    first_call_s: float | None = None  # in-process compile + first call (caches as they are)
    error: str | None = None
    mismatch: str | None = None
    fallback: list[str] = field(default_factory=list)  # rewritec fallback warnings
    traceback: str | None = None  # the end of the traceback, when `error` is set
    graphs: dict[str, int] = field(default_factory=dict)  # rewritec: graph records by status


@dataclass
class Probe:
    """A backend's compile probes of one case: every pair's times, and their medians."""

    cold_runs: list[float] = field(default_factory=list)
    warm_runs: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def cold_s(self) -> float | None:
        return statistics.median(self.cold_runs) if self.cold_runs else None

    @property
    def warm_s(self) -> float | None:
        return statistics.median(self.warm_runs) if self.warm_runs else None


@dataclass
class CaseResult:
    name: str
    label: str
    description: str
    shape: str = ""
    memory_bound: bool = False
    bytes_moved: int | None = None
    eager_ms: float | None = None  # median
    eager_min_ms: float | None = None
    eager_error: str | None = None
    backends: dict[str, BackendResult] = field(default_factory=dict)
    probes: dict[str, Probe] = field(default_factory=dict)
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    def ms(self, backend: str) -> float | None:
        r = self.backends.get(backend)
        return r.ms if r else None

    def speedup(self, backend: str) -> float | None:
        ms = self.ms(backend)
        return self.eager_ms / ms if ms and self.eager_ms else None

    def ratio(self) -> float | None:
        """rewritec time / Inductor time (< 1: rewritec is faster)."""
        rw, ind = self.ms("rewritec"), self.ms("inductor")
        return rw / ind if rw and ind else None

    def gbps(self) -> float | None:
        ms = self.ms("rewritec")
        if not self.memory_bound or not self.bytes_moved or not ms:
            return None
        return self.bytes_moved / (ms * 1e-3) / 1e9

    def rewritec_ok(self) -> bool:
        r = self.backends.get("rewritec")
        return r is not None and r.ms is not None and r.error is None and r.mismatch is None

    def status(self) -> str:
        if self.skipped:
            return "skipped"
        rw = self.backends.get("rewritec")
        parts: list[str] = []
        if self.eager_error:
            parts.append("eager error")
        if rw is not None and rw.mismatch:
            parts.append("MISMATCH")
        elif rw is not None and rw.error:
            parts.append("rewritec error")
        elif rw is not None and rw.fallback:
            parts.append("ok (fallback)")
        ind = self.backends.get("inductor")
        if ind is not None and ind.error:
            parts.append("inductor error")
        if ind is not None and ind.mismatch:
            parts.append("inductor mismatch")
        return ", ".join(parts) or "ok"


def clip(text: str, limit: int = 300) -> str:
    """One line, at most `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def short_error(e: BaseException, limit: int = 300) -> str:
    return clip(f"{type(e).__name__}: {e}", limit)


# --------------------------------------------------------------------------- measuring


def rewritec_backend() -> str | Callable[..., Any]:
    """"rewritec" when the entry point registered it (the normal case); else the function.

    The fallback covers a checkout that is on sys.path but not pip-installed.
    """
    try:
        torch._dynamo.lookup_backend("rewritec")
        return "rewritec"
    except Exception:  # noqa: BLE001 - not registered: import it directly
        from rewritec.frontend.backend import rewritec_backend as backend

        return backend


def compile_with(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    torch._dynamo.reset()
    if backend == "inductor":
        return torch.compile(fn)
    return torch.compile(fn, backend=rewritec_backend())


def check_close(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None when close; else the first lines of assert_close's message."""
    from torch.utils._pytree import tree_flatten

    got, _ = tree_flatten(actual)
    want, _ = tree_flatten(expected)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            return f"output {i}: " + " ".join(lines[:4])
    return None


def detach_clone(value: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def rewritec_records() -> list[Any]:
    with contextlib.suppress(Exception):
        from rewritec import report

        return list(report.RECORDS)
    return []


def measure_backend(inst: Instance, backend: str, expected: Any, timer: Timer,
                    limits: Limits, device: torch.device) -> BackendResult:
    res = BackendResult()
    before = len(rewritec_records())
    try:
        with warnings.catch_warnings(record=True) as caught, time_limit(limits.compile_s):
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            compiled = compile_with(inst.fn, backend)
            out = inst.run(compiled)
            synchronize(device)
            res.first_call_s = time.perf_counter() - t0
        res.fallback = sorted({" ".join(str(w.message).split()) for w in caught
                               if "Rewritec" in w.category.__name__})
        if backend == "rewritec":
            records = rewritec_records()[before:]
            for rec in records:
                status = str(getattr(rec, "status", "unknown"))
                res.graphs[status] = res.graphs.get(status, 0) + 1
        res.mismatch = check_close(out, expected, inst.rtol, inst.atol)
        del out
        with time_limit(limits.compile_s):
            timing = timer(lambda: inst.run(compiled))
            res.ms, res.min_ms = timing.median_ms, timing.min_ms
    except Exception as e:  # noqa: BLE001 - record and go on
        res.error = short_error(e)
        res.traceback = traceback.format_exc(limit=-8)
        if os.environ.get("REWRITEC_BENCH_TRACEBACK"):
            print(res.traceback, file=sys.stderr)
    finally:
        torch._dynamo.reset()
    return res


def run_case(case: Case, cfg: Config, timer: Timer, limits: Limits) -> CaseResult:
    result = CaseResult(name=case.name, label=case.name, description=case.description,
                        memory_bound=case.memory_bound)
    try:
        inst = case.build(cfg)
    except Skip as e:
        result.skipped = str(e)
        return result
    except Exception as e:  # noqa: BLE001
        result.skipped = f"could not build the case: {short_error(e)}"
        return result
    result.shape = inst.shape
    result.bytes_moved = inst.bytes_moved if case.memory_bound else None
    if inst.dtype_label:
        result.label = f"{case.name} ({inst.dtype_label})"
    if inst.note:
        result.notes.append(inst.note)

    grad_ctx = contextlib.nullcontext() if inst.training or inst.engine else torch.no_grad()
    with grad_ctx:
        if inst.engine:
            res = BackendResult()
            try:
                with time_limit(limits.compile_s):
                    timing = timer(lambda: inst.run(inst.fn))
                res.ms, res.min_ms = timing.median_ms, timing.min_ms
            except Exception as e:  # noqa: BLE001
                res.error = short_error(e)
            result.backends["rewritec"] = res
            return result
        try:
            with time_limit(limits.compile_s):
                expected = detach_clone(inst.run(inst.fn))
                timing = timer(lambda: inst.run(inst.fn))
            result.eager_ms, result.eager_min_ms = timing.median_ms, timing.min_ms
        except Exception as e:  # noqa: BLE001
            result.eager_error = short_error(e)
            return result
        for backend in BACKENDS:
            result.backends[backend] = measure_backend(inst, backend, expected, timer, limits,
                                                       cfg.device)
    gc.collect()
    if cfg.cuda:
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- compile probes


def probe_main(case_name: str, backend: str, cfg: Config) -> int:
    """Child process: time the first call of the compiled case; print one JSON line."""
    out: dict[str, Any] = {"case": case_name, "backend": backend}
    try:
        inst = BY_NAME[case_name].build(cfg)
        if inst.engine:
            raise Skip("the engine case has nothing to compile")
        grad_ctx = contextlib.nullcontext() if inst.training else torch.no_grad()
        start_dynamo(cfg.device)
        with grad_ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            synchronize(cfg.device)
            t0 = time.perf_counter()
            compiled = compile_with(inst.fn, backend)
            inst.run(compiled)
            synchronize(cfg.device)
            out["first_call_s"] = time.perf_counter() - t0
        out["fallback"] = sorted({" ".join(str(w.message).split()) for w in caught
                                  if "Rewritec" in w.category.__name__})
    except Exception as e:  # noqa: BLE001
        out["error"] = short_error(e)
    print(PROBE_MARKER + json.dumps(out), flush=True)
    return 0


def start_dynamo(device: torch.device) -> None:
    """Pay TorchDynamo's one-time start-up (imports, first trace) before timing.

    A trivial function compiled with Dynamo's `eager` backend imports neither
    Inductor nor rewritec, so what the probe then times is each backend's own
    work on the case: tracing, its compiler and its kernel builds.
    """
    warm = torch.compile(lambda t: t + 1, backend="eager")
    warm(torch.ones(4, device=device))
    synchronize(device)
    torch._dynamo.reset()


def run_probe(case: str, backend: str, cfg: Config, env: dict[str, str],
              timeout_s: float) -> tuple[float | None, str | None]:
    cmd = [sys.executable, "-m", "benchmarks.run", "--compile-probe", case, "--backend", backend,
           "--device", cfg.device.type, "--threads", str(torch.get_num_threads())]
    if cfg.quick:
        cmd.append("--quick")
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"probe timed out after {timeout_s:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARKER):
            data = json.loads(line[len(PROBE_MARKER):])
            return data.get("first_call_s"), data.get("error")
    tail = " ".join(proc.stderr.strip().splitlines()[-3:])
    return None, f"probe exited with {proc.returncode}: {tail[-300:]}"


def probe_pair(probe: Probe, case: str, backend: str, cfg: Config, limits: Limits,
               budget: Budget) -> None:
    """Cold then warm first-call time, each in a fresh subprocess, sharing fresh caches;
    added to `probe`'s runs (an error, recorded, ends the backend's probes)."""
    root = Path(tempfile.mkdtemp(prefix=f"rewritec-bench-{case}-{backend}-"))
    env = dict(os.environ)
    env.update({
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "REWRITEC_CACHE_DIR": str(root / "rewritec"),
    })
    try:
        for which in ("cold", "warm"):
            timeout = min(limits.probe_s, budget.remaining() - 2.0)
            if timeout < 5.0:
                probe.error = f"{which} probe skipped: time budget"
                break
            seconds, error = run_probe(case, backend, cfg, env, timeout)
            if seconds is not None:
                getattr(probe, f"{which}_runs").append(seconds)
            if error:
                probe.error = f"{which}: {error}"
                break
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- report


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def fmt_s(s: float | None) -> str:
    return "—" if s is None else f"{s:.1f}" if s >= 10 else f"{s:.2f}"


def fmt_pair(a: float | None, b: float | None) -> str:
    return "—" if a is None and b is None else f"{fmt_s(a)} / {fmt_s(b)}"


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summary(results: Sequence[CaseResult]) -> dict[str, Any]:
    """Geomeans over the cases where eager, Inductor and rewritec all ran and matched."""
    ok = [r for r in results if r.rewritec_ok() and r.ratio() and r.speedup("inductor")
          and r.speedup("rewritec")]
    return {
        "cases": len(ok),
        # rows where a rewritec graph ran through ATen instead (a rewritec result, but
        # all of them at once means a broken install, e.g. lark missing)
        "fallback_cases": sum(1 for r in ok if r.backends["rewritec"].fallback),
        "rewritec_over_inductor": geomean([r.ratio() or 0.0 for r in ok]),
        "inductor_speedup": geomean([r.speedup("inductor") or 0.0 for r in ok]),
        "rewritec_speedup": geomean([r.speedup("rewritec") or 0.0 for r in ok]),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: Sequence[CaseResult], env: dict[str, Any], copy_gbps: float | None,
             quick: bool, wall_s: float, probe_repeats: int = 1) -> str:
    header = ["case", "eager ms", "inductor ms", "rewritec ms", "inductor speedup",
              "rewritec speedup", "rewritec/inductor", "GB/s (rewritec)", "% copy BW",
              "cold compile rw / ind (s)", "warm compile rw / ind (s)", "status"]
    lines = [
        f"# rewritec benchmarks: {env['device']}{' (quick)' if quick else ''}",
        "",
        f"- device: {env['device_name']}",
        (f"- torch {env['torch']}, triton {env['triton']}, python {env['python']}, "
         f"rewritec {env['rewritec']} @ {env['git_commit']}"),
        (f"- date: {env['date']}; timing: {env['timing']} (median); run took {wall_s:.0f} s; "
         f"load average at start: {env['load_average']}"),
        (f"- copy bandwidth (dst.copy_(src), read + write): "
         f"{'—' if copy_gbps is None else f'{copy_gbps:.1f} GB/s'}"),
        ("- rewritec/inductor is a time ratio: below 1 means rewritec is faster. "
         "Speedups are eager time / compiled time."),
        ("- compile times: the first call in a fresh process with fresh caches (cold) or "
         "the caches of the cold run (warm), after TorchDynamo has started once on a "
         "trivial function (see `start_dynamo`); the median of "
         f"{probe_repeats} pair(s) of processes per backend, interleaved, each pair "
         "listed in the JSON."),
        *([f"- **warning**: {env['busy_warning']}"] if env.get("busy_warning") else []),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|",
    ]
    notes: list[str] = []
    for r in results:
        gbps = r.gbps()
        pct = f"{100 * gbps / copy_gbps:.0f}%" if gbps and copy_gbps else "—"
        rw_probe, ind_probe = r.probes.get("rewritec"), r.probes.get("inductor")
        row_notes = list(r.notes)
        if r.skipped:
            row_notes.append(r.skipped)
        if r.eager_error:
            row_notes.append(f"eager: {r.eager_error}")
        for name, b in r.backends.items():
            if b.error:
                row_notes.append(f"{name} error: {b.error}")
            if b.mismatch:
                row_notes.append(f"{name} MISMATCH vs eager: {b.mismatch}")
            row_notes += [clip(msg) for msg in b.fallback[:2]]
        for name, p in r.probes.items():
            if p.error:
                row_notes.append(f"{name} compile probe: {p.error}")
        status = r.status()
        if row_notes:
            refs = []
            for n in row_notes:
                notes.append(f"{len(notes) + 1}. `{r.name}`: {n}")
                refs.append(str(len(notes)))
            status += f" [{','.join(refs)}]"
        cells = [
            r.label, fmt_ms(r.eager_ms), fmt_ms(r.ms("inductor")), fmt_ms(r.ms("rewritec")),
            fmt_x(r.speedup("inductor")), fmt_x(r.speedup("rewritec")),
            "—" if r.ratio() is None else f"{r.ratio():.2f}",
            "—" if gbps is None else f"{gbps:.1f}", pct,
            fmt_pair(rw_probe.cold_s if rw_probe else None,
                     ind_probe.cold_s if ind_probe else None),
            fmt_pair(rw_probe.warm_s if rw_probe else None,
                     ind_probe.warm_s if ind_probe else None),
            status,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    s = summary(results)
    lines += ["", (f"Geomean over {s['cases']} case(s) where all three ran and rewritec "
                   f"matched eager: rewritec/inductor {fmt_ratio(s['rewritec_over_inductor'])}, "
                   f"inductor speedup {fmt_x(s['inductor_speedup'])}, "
                   f"rewritec speedup {fmt_x(s['rewritec_speedup'])}"
                   + (f"; {s['fallback_cases']} of these case(s) ran a graph through ATen "
                      f"(`ok (fallback)`)." if s["fallback_cases"] else "."))]
    lines += ["", "Shapes: " + "; ".join(f"`{r.name}` {r.shape}" for r in results if r.shape)]
    if notes:
        lines += ["", "Notes:", "", *(_cell(n) for n in notes)]
    return "\n".join(lines) + "\n"


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


# --------------------------------------------------------------------------- main


def select_cases(spec: str | None) -> list[Case]:
    if not spec:
        return list(CASES)
    chosen: list[Case] = []
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pattern)
                or c.name.startswith(pattern + "_")]
        if not hits:
            raise SystemExit(f"unknown case {pattern!r}; known: {', '.join(BY_NAME)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small shapes, few repeats, compile probes for 1-2 cases, a time budget")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--cases", default=None,
                   help="comma-separated names or globs (a prefix like 'softmax' selects "
                        "softmax_*)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--repeats", type=int, default=None, help="timing samples per measurement")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run and its compile probes "
                        "(default: torch's choice)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="soft limit for the whole run in seconds (--quick: 170 on the CPU, "
                        "540 on CUDA)")
    p.add_argument("--probe-cases", default=None,
                   help="cases whose cold/warm compile is probed (default: all; --quick: "
                        f"{','.join(QUICK_PROBE_CASES)}); 'none' for no probes")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown output path (default benchmarks/results/<device>.md); "
                        "the JSON goes beside it")
    p.add_argument("--suite", choices=SUITES, default="cases",
                   help="cases: this harness (the default); models: real models, "
                        "`python -m benchmarks.models` with the other options")
    p.add_argument("--compile-probe", metavar="CASE", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, default="rewritec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def suite_of(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The --suite chosen, and the other arguments."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--suite", choices=SUITES, default="cases")
    known, rest = p.parse_known_args(argv)
    return known.suite, rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite, rest = suite_of(argv)
    if suite == "models":
        # its own process: benchmarks.models builds on this module's helpers
        return subprocess.call([sys.executable, "-m", "benchmarks.models", *rest], cwd=REPO_ROOT)
    args = parse_args(argv)
    if args.list:
        for c in CASES:
            print(f"{c.name:18} {'memory-bound ' if c.memory_bound else ''}{c.description}")
        return 0
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    device = torch.device(dev)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(device=device, quick=args.quick)
    torch.manual_seed(0)
    if args.compile_probe:
        return probe_main(args.compile_probe, args.backend, cfg)

    limits = Limits.make(args.quick, args.time_budget, args.repeats, cuda=device.type == "cuda")
    budget = Budget(limits.budget_s)
    timer = Timer(device, limits)
    selected = select_cases(args.cases)
    if args.probe_cases is None:
        probe_names = [n for n in QUICK_PROBE_CASES] if args.quick else [c.name for c in CASES]
    elif args.probe_cases.strip().lower() == "none":
        probe_names = []
    else:
        probe_names = [c.name for c in select_cases(args.probe_cases)]
    probe_names = [n for n in probe_names if any(c.name == n for c in selected)
                   and BY_NAME[n].kind == "model"]

    env = environment(device, timer)
    print(f"device: {env['device_name']}; torch {env['torch']}; triton {env['triton']}; "
          f"timing: {timer.method}", flush=True)
    copy_gbps: float | None = None
    try:
        copy_gbps = copy_bandwidth(device, timer, args.quick)
        print(f"copy bandwidth: {copy_gbps:.1f} GB/s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"copy bandwidth: failed ({short_error(e)})", flush=True)

    results: list[CaseResult] = []
    load = ForeignLoad()
    reserve = limits.probe_reserve_s if probe_names else 0.0
    for case in selected:
        if budget.remaining() < reserve:
            skipped = CaseResult(name=case.name, label=case.name, description=case.description,
                                 memory_bound=case.memory_bound,
                                 skipped="not run: time budget exhausted")
            results.append(skipped)
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        r = run_case(case, cfg, timer, limits)
        results.append(r)
        print(f"  {r.label:24} eager {fmt_ms(r.eager_ms):>8}  "
              f"inductor {fmt_ms(r.ms('inductor')):>8}"
              f"  rewritec {fmt_ms(r.ms('rewritec')):>8}  {r.status():18} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)

    foreign = load.cores()
    env["foreign_load_cores"] = None if foreign is None else round(foreign, 2)
    env["busy_warning"] = busy_warning(device, foreign)
    if env["busy_warning"]:
        print(f"warning: {env['busy_warning']}", flush=True)

    by_name = {r.name: r for r in results}
    for name in probe_names:
        r = by_name[name]
        if r.skipped:
            continue
        # pairs of the two backends interleave, so a slow spell of the machine
        # lands on both
        for pair in range(limits.probe_repeats):
            for backend in ("rewritec", "inductor"):
                p = r.probes.setdefault(backend, Probe())
                if p.error:
                    continue
                if budget.remaining() < 10.0:
                    if not p.cold_runs:
                        p.error = "skipped: time budget"
                    continue
                t0 = time.perf_counter()
                probe_pair(p, name, backend, cfg, limits, budget)
                print(f"  compile probe {name} / {backend} #{pair + 1}: cold "
                      f"{fmt_s(p.cold_runs[-1] if p.cold_runs else None)} s, warm "
                      f"{fmt_s(p.warm_runs[-1] if p.warm_runs else None)} s"
                      f"{' (' + p.error + ')' if p.error else ''} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)

    wall = budget.elapsed()
    text = markdown(results, env, copy_gbps, args.quick, wall, limits.probe_repeats)
    md_path = args.out or RESULTS_DIR / f"{device.type}.md"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    raw = {
        "environment": env,
        "quick": args.quick,
        "wall_s": wall,
        "limits": asdict(limits),
        "copy_bandwidth_gbps": copy_gbps,
        "summary": summary(results),
        "cases": [{**asdict(r), "speedup_inductor": r.speedup("inductor"),
                   "speedup_rewritec": r.speedup("rewritec"),
                   "rewritec_over_inductor": r.ratio(), "gbps_rewritec": r.gbps(),
                   "compile_s": {k: {"cold": p.cold_s, "warm": p.warm_s}
                                 for k, p in r.probes.items()},
                   "pct_copy_bandwidth": (100 * r.gbps() / copy_gbps
                                          if r.gbps() and copy_gbps else None),
                   "status": r.status()} for r in results],
    }
    md_path.with_suffix(".json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    print()
    print(text)
    print(f"wrote {md_path} and {md_path.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
