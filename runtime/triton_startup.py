"""Triton's one-time start-up, begun on a thread while a CUDA graph is traced.

The first Triton kernel a process launches pays for Triton's own start-up:
importing it, building (fresh cache) or loading its CUDA driver module, and
the key of its kernel cache (`triton_key`), a hash of its installed files,
libtriton's half gigabyte included: 0.35 s on an H200 host, 1.15 s on an H100
host with a cold page cache, in every process. rewritec keys Triton's cache by
a fingerprint of the same files instead (`installed_fingerprint`: their paths,
sizes and modification times, a few milliseconds), so any change to an
installed Triton file still changes the key. Its CUDA driver's C utility module
is built or loaded only when used (`_deferred_cuda_driver`): rewritec compiles
kernels with targets from torch and launches them with torch's static launcher,
so a fresh cache no longer builds it (0.4 s of gcc on an H100 host's start-up
thread, about 0.1 s of it waited for).
None of this depends on the graph.
So the backend calls `start()` as soon as it receives a graph with CUDA
inputs, and the work runs while AOTAutograd traces and the rules rewrite; most
of it holds no GIL (reading files, waiting on the C compiler). `wait()`,
called before the first Triton kernel is loaded, joins the thread, so the two
never race. A failure here is ignored: the kernel build that follows meets the
same problem and reports it (or falls back to ATen) itself.

Where the compile worker runs (runtime/ahead.py), this process compiles no
kernel of its own unless a launch was not foreseen, so the backend `defer()`s the
start-up to that launch instead: beside the main thread it would mostly hold the
GIL that TorchDynamo and the rules need.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import threading
from pathlib import Path

import torch

_lock = threading.Lock()
_thread: threading.Thread | None = None
_deferred = False


def _start_up() -> None:
    import triton  # the point of this module: Triton imported off the main thread
    from triton.runtime import cache, driver

    if hasattr(cache, "triton_key"):  # where triton 3.x keeps it
        root = Path(cache.__file__).resolve().parents[1]  # triton/runtime/cache.py -> triton/
        value = f"rewritec-{installed_fingerprint(root, triton.__version__)}"
        # Triton's own process pools hand their workers the key the same way.
        cache.triton_key = lambda: value
    if vars(driver).get("_active") is None:  # nothing in this process has used it yet
        deferred = _deferred_cuda_driver()
        if deferred is not None:
            driver.set_active(deferred)
    driver.active.get_current_target()
    _import_compiler()


# What Triton imports at its first compile rather than at `import triton` (a new
# process's first kernel spent 0.06 s of an H100 host's cold compile reading gluon's
# files); the start-up thread reads them while the main thread traces.
COMPILER_MODULES = ("triton.compiler.compiler", "triton.compiler.code_generator",
                    "triton.language.semantic", "triton.language.extra.libdevice",
                    "triton.backends.nvidia.compiler", "triton.experimental.gluon")


def _import_compiler() -> None:
    for name in COMPILER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this Triton: its compile does not import it either
            pass


def _deferred_cuda_driver() -> object | None:
    """Triton's CUDA driver, whose C utility module is built (with the host's C
    compiler, on a fresh cache) or loaded only when something uses it.

    Compiling a kernel needs the driver only for the device, its stream and its
    target, which it takes from torch; loading and launching a binary through
    torch's static launcher (runtime/static_launch.py) needs no utility module at
    all. Only a kernel the JIT itself launches does, and it still gets one, at its
    first use. None (the usual driver) for a Triton whose CUDA driver is not laid
    out as the ones read here (3.6 to 3.9: `CudaDriver.__init__` builds `utils`
    and sets `launcher_cls`, `GPUDriver.__init__` reads the rest from torch)."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    try:
        from triton.backends.driver import GPUDriver
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    if not (hasattr(nvidia, "CudaUtils") and hasattr(nvidia, "CudaLauncher")
            and issubclass(nvidia.CudaDriver, GPUDriver)):
        return None

    class DeferredCudaDriver(nvidia.CudaDriver):
        def __init__(self) -> None:
            GPUDriver.__init__(self)  # device, stream and capability from torch
            self.launcher_cls = nvidia.CudaLauncher

        @functools.cached_property
        def utils(self) -> object:
            return nvidia.CudaUtils()

    return DeferredCudaDriver()


def installed_fingerprint(root: Path, version: str) -> str:
    """A hash of the Triton installed at `root`: its version and the path, size and
    modification time of each file `installed_files` names."""
    h = hashlib.sha256(version.encode())
    for f in installed_files(root):
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def installed_files(root: Path) -> list[Path]:
    """The files of the Triton installed at `root` whose change changes what it
    compiles: its library, runtime cache and compiler, backends and language."""
    files = [root / "runtime" / "cache.py", *sorted((root / "_C").glob("libtriton*"))]
    for sub in ("compiler", "backends", "language"):
        files += sorted((root / sub).rglob("*.py"))
    return files


def _warm() -> None:
    try:
        _start_up()
    except Exception:  # noqa: BLE001 - see the module docstring
        pass


def start() -> None:
    """Begin the start-up in the background (once per process)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_warm, name="rewritec-triton-startup", daemon=True)
            _thread.start()


def defer() -> None:
    """Run the start-up when a kernel first needs Triton in this process (`wait`),
    not now: the compile worker (runtime/ahead.py) compiles this process's kernels,
    and a start-up beside the main thread would only hold the GIL it needs."""
    global _deferred
    _deferred = True


def wait() -> None:
    """Block until a started start-up has finished (a deferred one is run first);
    return at once otherwise."""
    if _thread is None and _deferred:
        start()
    thread = _thread
    if thread is not None:
        thread.join()
