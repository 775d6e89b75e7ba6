"""Triton kernels compiled ahead of their first launch, in worker processes.

A CUDA graph's first call used to compile its Triton kernels on the main
thread, at their first launch: Triton's start-up in the process, then each
kernel, one after the other (0.15-0.25 s a kernel on an H100 host), all after
TorchDynamo, AOTAutograd and the rules had finished. Python threads cannot run
that beside the main thread: both hold the GIL for most of their work (on the
2-core CPU machine a compile on a thread beside a busy main thread took 6.4 s
instead of 0.08).

So a worker process (runtime/compile_worker.py, which imports neither torch nor
rewritec) is started when the backend is first looked up in a process that uses
CUDA, or at the latest when a CUDA graph arrives. It imports Triton and, unless a
job is already waiting, compiles a small kernel while the graph is traced and
rewritten, paying Triton's first-compile costs there. Once a graph's kernels are
rendered, `submit_graph` runs the graph's launchers on meta tensors (sizes, strides
and dtypes, no data) to learn the exact arguments of each kernel's first launch
(0.6 ms for a layer_norm graph), starts more workers if the graph has more kernels
than there are workers (up to `pool_size()`), and queues each kernel for the pool,
which hands it to a ready, idle worker. At that launch, `DirectKernel`
(runtime/triton_direct.py) takes the worker's binary, stores it as
runtime/static_launch.py stores any binary, and launches it through torch's static
launcher: the main process compiles nothing and never starts Triton's compiler.

What it buys: a graph's kernels compile side by side (8 kernels on the 2-core CPU
machine, two workers: 0.25-0.29 s against 0.49 in one process), and Triton's import
and first-compile costs overlap the main thread's tracing. On an H100 host a cold
one-kernel graph took 0.32-0.56 s with the workers against 0.38-0.67 s without
(benchmarks/results/cuda.md; scripts/compile_worker_sim.py simulates both on a CPU).

A binary is used only for the call it was compiled for (the same key as every
stored binary: each argument's dtype and address modulo 16, every integer's
value, the constexprs and the device's capability), so a call that differs from
the prediction (a misaligned input, say) compiles through the JIT as before.
Anything that fails here (no worker, a worker that dies, a kernel it cannot
compile) only means the JIT compiles that kernel at its launch.
`REWRITEC_COMPILE_WORKER=0` turns the workers off.
"""

from __future__ import annotations

import atexit
import base64
import collections
import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version
from types import SimpleNamespace
from typing import Any

import torch

from ..aten.dtypes import TORCH_DTYPES
from . import static_launch
from .triton_direct import DirectKernel, call_key, current_target
from .triton_startup import COMPILER_MODULES, installed_fingerprint

WORKER = Path(__file__).with_name("compile_worker.py")
# Longest wait for the worker's binary at a launch; then the JIT compiles it.
WAIT_S = 120.0


class Job:
    """One kernel the worker compiles; `wait()` gives what `describe` reads of a
    compiled kernel (runtime/static_launch.py), or None."""

    def __init__(self, target: tuple[str, int, int]) -> None:
        self.target = target
        self.done = threading.Event()
        self.compiled: Any = None
        self.error: str | None = None

    def finish(self, reply: dict[str, Any] | None, error: str | None = None) -> None:
        if reply is not None and reply.get("ok"):
            self.compiled = SimpleNamespace(
                metadata=SimpleNamespace(**reply["metadata"]),
                src=SimpleNamespace(fn=SimpleNamespace(arg_names=reply["arg_names"]),
                                    signature=reply["signature"]),
                asm={"cubin": base64.b64decode(reply["cubin"])})
        else:
            self.error = error or (reply or {}).get("error", "no answer")
        self.done.set()

    def wait(self, timeout: float = WAIT_S) -> Any:
        return self.compiled if self.done.wait(timeout) else None


class Worker:
    """The child process and the thread that reads its answers."""

    def __init__(self, triton_key: str | None, warm: tuple[str, int, int] | None,
                 command: list[str] | None = None,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.on_idle = on_idle  # the pool's dispatcher: ready, or a job answered
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()  # graphs compiled on two threads send whole lines
        self.next_id = 0
        self.ready = threading.Event()
        self.dead: str | None = None
        self.pid = os.getpid()  # a forked child must not write to its parent's worker
        self.proc = subprocess.Popen(
            command or [sys.executable, "-u", str(WORKER)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        self._send({"triton_key": triton_key, "imports": list(COMPILER_MODULES),
                    "warm": list(warm) if warm else None})
        self.reader = threading.Thread(target=self._read, name="rewritec-compile-worker",
                                       daemon=True)
        self.reader.start()

    def _send(self, obj: dict[str, Any]) -> bool:
        try:
            assert self.proc.stdin is not None
            with self.write_lock:
                self.proc.stdin.write(json.dumps(obj) + "\n")
                self.proc.stdin.flush()
            return True
        except (OSError, ValueError) as e:
            self._fail(f"cannot write to the worker: {e}")
            return False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                reply = json.loads(line)
                if reply.get("ready"):
                    self.ready.set()
                else:
                    with self.lock:
                        job = self.jobs.pop(reply.get("id"), None)
                    if job is not None:
                        job.finish(reply)
                if self.on_idle is not None:
                    self.on_idle()
        except (OSError, ValueError) as e:
            self._fail(f"unreadable answer: {e}")
            return
        self._fail(f"the worker exited ({self.proc.poll()})")

    def _fail(self, why: str) -> None:
        with self.lock:
            self.dead = self.dead or why
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            job.finish(None, why)
        if self.on_idle is not None:
            self.on_idle()  # what waits for a worker goes to another, or fails

    def submit(self, path: str, symbol: str, target: tuple[str, int, int],
               args: list[dict[str, Any]], kwargs: dict[str, Any],
               job: Job | None = None) -> Job:
        job = job or Job(target)
        with self.lock:
            if self.dead is not None:
                job.finish(None, self.dead)
                return job
            self.next_id += 1
            self.jobs[self.next_id] = job
            number = self.next_id
        self._send({"id": number, "path": path, "symbol": symbol, "target": list(target),
                    "args": args, "kwargs": kwargs})
        return job

    def close(self) -> None:
        """End the worker: it exits when its input closes; one still compiling (a
        warm-up) is killed rather than waited for, at the parent's exit."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=0.2)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
        # its output, once the reader has read to the end (else Python warns of an
        # unclosed file at exit, one a worker)
        self.reader.join(timeout=0.2)
        if not self.reader.is_alive() and self.proc.stdout is not None:
            self.proc.stdout.close()


# The pool: its workers and the jobs waiting for one. A job goes to a worker that is
# ready (Triton imported) and idle, so a worker still starting takes no job another
# will be free for sooner; while none is ready yet, to any idle one.
_lock = threading.RLock()  # a worker's failure, inside a dispatch, dispatches again
_workers: list[Worker] = []
_queue: collections.deque[tuple[Job, tuple[Any, ...]]] = collections.deque()


def pool_size() -> int:
    """Workers to start, so that a graph's kernels compile side by side: half the
    cores less the main process's, at least 1 and at most 4
    (`REWRITEC_COMPILE_WORKERS` sets it)."""
    configured = os.environ.get("REWRITEC_COMPILE_WORKERS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, min(4, ((os.cpu_count() or 2) - 1) // 2))


def enabled() -> bool:
    """Whether kernels are compiled in a worker: CUDA (not ROCm), torch's static
    launcher, Triton installed, its interpreter off, and not turned off."""
    return (os.environ.get("REWRITEC_COMPILE_WORKER", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and torch.version.hip is None and importlib.util.find_spec("triton") is not None
            and static_launch.available())


@functools.cache
def triton_key() -> str | None:
    """A key for the workers' Triton cache, made as runtime/triton_startup.py makes
    this process's (a fingerprint of Triton's files) without importing Triton: Triton's
    own key hashes libtriton, up to a second a process."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        triton_version = version("triton")
    except PackageNotFoundError:  # installed under another name (pytorch-triton):
        triton_version = ""  # the files' sizes and times still key it
    root = Path(next(iter(spec.submodule_search_locations)))
    return f"rewritec-{installed_fingerprint(root, triton_version)}"


def start() -> bool:
    """Start the first worker (once per process) where `enabled()`; whether one runs.
    More start when a graph has more kernels than workers (`grow`)."""
    with _lock:
        if _workers and _workers[0].pid != os.getpid():
            _workers.clear()  # this is a fork: those workers answer the parent
            _queue.clear()
        if not _workers:
            try:
                if not enabled():
                    return False
                _spawn(current_target())
            except Exception:  # noqa: BLE001 - no worker: kernels compile at their launch
                pass
    return running()


def _spawn(warm: tuple[str, int, int] | None) -> None:
    worker = Worker(triton_key(), warm, on_idle=_dispatch)
    _workers.append(worker)
    atexit.register(worker.close)


def grow(kernels: int) -> None:
    """Up to `pool_size()` workers for a graph of `kernels` kernels, where `start` has
    started the pool (it alone checks `enabled()`). The new ones skip the warm-up
    compile: jobs are waiting for them."""
    with _lock:
        try:
            while _alive() and len(_alive()) < min(kernels, pool_size()):
                _spawn(None)
        except Exception:  # noqa: BLE001 - those that started serve
            pass


def _alive() -> list[Worker]:
    return [w for w in _workers if w.dead is None and w.pid == os.getpid()]


def running() -> bool:
    return bool(_alive())


def submit(path: str, symbol: str, target: tuple[str, int, int], args: list[dict[str, Any]],
           kwargs: dict[str, Any]) -> Job | None:
    """Queue one kernel for the pool; None where no worker runs."""
    if not running():
        return None
    job = Job(target)
    with _lock:
        _queue.append((job, (path, symbol, target, args, kwargs)))
    _dispatch()
    return job


def _dispatch() -> None:
    """Hand waiting jobs to idle workers, ready ones first (see `_queue`)."""
    with _lock:
        while _queue:
            alive = _alive()
            if not alive:
                for job, _ in _queue:
                    job.finish(None, "no compile worker runs")
                _queue.clear()
                return
            idle = [w for w in alive if not w.jobs]
            if any(w.ready.is_set() for w in alive):
                idle = [w for w in idle if w.ready.is_set()]
            if not idle:
                return
            job, (path, symbol, target, args, kwargs) = _queue.popleft()
            idle[0].submit(path, symbol, target, args, kwargs, job=job)


def encode(value: Any) -> dict[str, Any] | None:
    """A launch argument as the worker takes it; None for one it cannot."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."),
                "align": value.data_ptr() & 15}
    if type(value) in (int, float, bool):
        return {type(value).__name__: value}
    if value is None:
        return {"none": None}
    return None


class Recorder:
    """Stands in for a launcher's kernel during `predict`: records each launch."""

    def __init__(self, kernel: Any, calls: list[tuple[Any, ...]]) -> None:
        self.kernel = kernel
        self.calls = calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            # with the kernel's own compile options, as DirectKernel launches it
            options = getattr(self.kernel, "options", None) or {}
            self.calls.append((self.kernel, grid, args, {**kwargs, **options}))

        return launch


def _meta_tensor(term: Any) -> Any:

    m = term.meta
    return torch.empty_strided(tuple(m.shape), tuple(m.strides), dtype=TORCH_DTYPES[m.dtype],
                               device="meta")


def predict(graph: Any, launchers: dict[Any, Any], is_kernel: Callable[[Any], bool]
            ) -> list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]]:
    """The first launch of each kernel of `graph`: (kernel, grid, args, kwargs).

    Each launcher runs, in graph order, on meta tensors with its operands' sizes,
    strides and dtypes (a kernel's operand made by an earlier kernel: that launch's
    output, as allocated); its kernels (`is_kernel` picks them among its attributes)
    are swapped for recorders meanwhile. The launchers are new, so no other thread
    can be launching them. A launcher that cannot run so is left out."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compiling runs under AOTAutograd's fake mode
        return _predict(graph, launchers, is_kernel)


def _predict(graph: Any, launchers: dict[Any, Any], is_kernel: Callable[[Any], bool]
             ) -> list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]]:
    calls: list[tuple[Any, ...]] = []
    made: dict[Any, Any] = {}
    for t in graph.terms():
        launcher = launchers.get(t)
        if launcher is None:
            continue
        swapped = {k: v for k, v in vars(launcher).items() if is_kernel(v)}
        try:
            inputs = [made[a] if a in made else
                      made[a.args[0]][a.attr("index")]
                      if a.op == "getitem" and a.args[0] in made else  # a side output
                      a.value if a.op == "const" else _meta_tensor(a) for a in t.args]
            for k, v in swapped.items():
                setattr(launcher, k, Recorder(v, calls))
            made[t] = launcher.launch(*inputs)
        except Exception:  # noqa: BLE001 - not predicted: the JIT compiles it at launch
            continue
        finally:
            for k, v in swapped.items():
                setattr(launcher, k, v)
    return calls


def submit_graph(graph: Any, launchers: dict[Any, Any]) -> int:
    """Send the first launch of each Triton kernel of `graph` to the worker; the
    kernels' DirectKernels take the binaries at that launch. The count sent."""

    if not running():
        return 0
    target = current_target()
    sent = 0
    calls = predict(graph, launchers, lambda v: isinstance(v, DirectKernel))
    grow(len(calls))
    for kernel, grid, args, kwargs in calls:
        if kernel.path is None or kernel.binaries is None or type(grid) is not tuple:
            continue
        encoded = [e for e in (encode(a) for a in args) if e is not None]
        if len(encoded) != len(args) or not all(
                type(v) in (int, float, bool) for v in kwargs.values()):
            continue
        try:
            call = call_key(args, kwargs)
            hash(call)
        except TypeError:
            continue
        if call in kernel.pending:
            continue
        job = submit(str(kernel.path), kernel.symbol, target, encoded, dict(kwargs))
        if job is not None:
            kernel.pending[call] = job
            sent += 1
    return sent
