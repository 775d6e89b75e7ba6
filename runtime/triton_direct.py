"""Launching a Triton kernel straight through the binary its JIT compiled.

`kernel[grid](*args)` through Triton's JIT binds every argument, computes its
specialization (pointer alignment, integers equal to 1 or divisible by 16,
dtypes) and looks the compiled kernel up on each call: about 17 us of host time
a launch on an H200 host, against 11 us through the compiled kernel itself.
A compiled graph launches the same kernels with the same few argument
combinations call after call, so `DirectKernel` remembers, per call signature,
the compiled kernel the JIT returned and launches through it from then on.

The signature is finer than Triton's specialization, so a remembered kernel is
never launched on arguments the JIT would have compiled differently: each
tensor's dtype and its address modulo 16, every other argument's type and
value, the constexpr and launch options, the grid and the current device. Any
call that does not match goes through the JIT as before. Under the Triton
interpreter (`TRITON_INTERPRET=1`), or for a kernel whose constexpr parameters
are not all passed (positionally or by name), every call goes through the JIT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Signatures remembered per kernel; beyond this (shapes that change every call)
# calls go through the JIT.
LIMIT = 64


def _jit_params(jit: Any) -> list[tuple[str, bool]] | None:
    """(name, is_constexpr) for each parameter, when `jit` is a compiled-mode
    JITFunction; None for the interpreter's kernels or an unknown Triton."""
    try:
        from triton.runtime.jit import JITFunction  # Triton on first use, as below
    except ImportError:  # pragma: no cover - Triton missing: no Triton kernels either
        return None
    if not isinstance(jit, JITFunction):
        return None
    try:
        return [(p.name, bool(p.is_constexpr)) for p in jit.params]
    except AttributeError:
        return None


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each argument as the key reads it: an int as itself (most arguments are
    sizes and strides), a tensor as its dtype and address modulo 16, anything
    else as its type and value (so that 1, 1.0 and True differ). A launch takes
    two dozen arguments, so this runs on every call: ~1.5 us against ~4.5 for a
    function call per argument."""
    tensor = torch.Tensor
    return tuple([a if type(a) is int else (a.dtype, a.data_ptr() & 15)
                  if isinstance(a, tensor) else (type(a), a) for a in args])


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a launch is remembered, stored and found by, less grid and device."""
    return (tuple(kwargs.items()), _signature(args))


def _current_device() -> int:
    # torch.cuda.current_device() less its lazy-init check: a kernel that ran once
    # has initialized CUDA
    return torch._C._cuda_getDevice()


# Appended to a `watch` list by a launch that must not be learned as a plan
# (autotuning's timing launches every candidate): runtime/launch.py: Launcher._learn
POISON: Any = object()



def current_target(device: int | None = None) -> tuple[str, int, int]:
    """Triton's target for the CUDA device (the current one by default)."""
    major, minor = torch.cuda.get_device_capability(device)
    return ("cuda", major * 10 + minor, 32)

class DirectKernel:
    """Used like the JIT function it wraps: `kernel[grid](*args, **constexprs)`.

    `load` instead of `jit` defers importing the kernel (and Triton) to the first
    call that needs the JIT; with `binaries` (runtime/static_launch.py), a call
    whose binary an earlier process stored launches it without the JIT at all, and
    so does a call the compile worker compiled ahead (runtime/ahead.py: `pending`,
    by call key, with the kernel's module file `path` and `symbol`).
    """

    def __init__(self, jit: Any = None, params: list[tuple[str, bool]] | None = None,
                 device: Callable[[], int] = _current_device, *,
                 load: Callable[[], Any] | None = None, binaries: Any = None,
                 path: Any = None, symbol: str | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self._jit_fn = jit
        self.options = options or {}  # compile options every launch passes
        self._load = load
        self.path = path
        self.symbol = symbol
        self.pending: dict[Any, Any] = {}
        self.params = params if params is not None or jit is None else _jit_params(jit)
        self.device = device
        self.binaries = binaries
        self.runners: dict[Any, tuple[Callable[..., Any], tuple[Any, ...], Any]] = {}
        self.direct = 0  # launches that skipped the JIT (tests read these three)
        self.jitted = 0  # launches through the JIT
        self.stored = 0  # launches of a binary stored by an earlier process
        self.ahead = 0  # binaries compiled without launching, then launched statically
        self.from_worker = 0  # binaries the compile worker compiled, launched statically
        self.disabled: str | None = None  # why every call goes through the JIT
        # While a list, each launch through a remembered runner appends (runner, args,
        # constexpr tail) to it (runtime/launch.py: Launcher._learn)
        self.watch: list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]] | None = None

    def _loaded(self) -> Any:
        """The JIT function, loaded on first use (which also sets `params`)."""
        if self._jit_fn is None:
            assert self._load is not None, "DirectKernel needs a jit or a load"
            self._jit_fn = self._load()
            if self.params is None:
                self.params = _jit_params(self._jit_fn)
        return self._jit_fn

    jit = property(_loaded)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            return self.launch(grid, args, {**kwargs, **self.options} if self.options
                               else kwargs)

        return launch

    def launch(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._jit_fn is None and self.binaries is None:
            self._loaded()  # no binary to find: the JIT's parameters are needed
        if self.disabled is not None or type(grid) is not tuple or (
                self.params is None and self._jit_fn is not None):
            return self._jit(grid, args, kwargs)
        device = self.device()
        call = call_key(args, kwargs)
        key = (grid, device, call)
        try:
            hit = self.runners.get(key)
        except TypeError:  # an unhashable argument: nothing to remember it by
            return self._jit(grid, args, kwargs)
        if hit is None and self.binaries is not None:
            run = self.binaries.find(call, device, grid)
            if run is not None:
                self.stored += 1
            else:
                run = self._from_worker(grid, len(args), call, device)
            if run is None:
                run = self._compile_ahead(grid, args, kwargs, call, device)
            if run is not None:
                hit = self.runners[key] = (run, (), None)
        if hit is not None:
            run, tail, compiled = hit
            try:
                run(*args, *tail)
            except Exception as e:  # noqa: BLE001 - a launcher that differs: the JIT from now on
                self.disabled = f"direct launch failed: {type(e).__name__}: {e}"
                self.runners.clear()
                return self._jit(grid, args, kwargs)
            self.direct += 1
            if self.watch is not None:  # runtime/launch.py: Launcher learning a plan
                self.watch.append((run, args, tail))
            return compiled
        compiled = self._jit(grid, args, kwargs)
        if len(self.runners) < LIMIT and self.params is not None:
            runner = self._runner(compiled, grid, len(args), kwargs)
            if runner is not None:
                self.runners[key] = runner
                if self.binaries is not None:
                    self.binaries.keep(call, device, compiled, len(args))
        return compiled

    def _from_worker(self, grid: tuple[Any, ...], n_args: int, call: tuple[Any, ...],
                     device: int) -> Callable[..., None] | None:
        """The binary the compile worker made for this call (runtime/ahead.py), stored
        and launched through the static launcher; None where there is none."""
        job = self.pending.pop(call, None)
        if job is None:
            return None
        compiled = job.wait()
        if compiled is None or job.target != current_target(device):
            return None
        run = self.binaries.keep(call, device, compiled, n_args, grid)
        if run is not None:
            self.from_worker += 1
        return run

    def _compile_ahead(self, grid: tuple[Any, ...], args: tuple[Any, ...],
                       kwargs: dict[str, Any], call: tuple[Any, ...], device: int
                       ) -> Callable[..., None] | None:
        """A new call's binary, compiled by the JIT without launching (`warmup`),
        stored, and launched through the static launcher from this first call on.

        A JIT launch would also build Triton's launcher module with the host's C
        compiler on a fresh cache (about 0.3 s of a cold compile on an H100 host);
        the static launcher needs none. None (the JIT launches) when the binary
        cannot be stored or found again."""
        if len(self.runners) >= LIMIT:
            return None
        jit = self._loaded()
        tail = (self.params or [])[len(args):]
        if self.params is None or not all(c and name in kwargs for name, c in tail):
            return None
        try:
            compiled = jit.warmup(*args, grid=grid, **kwargs)
        except Exception:  # noqa: BLE001 - the JIT's launch meets and reports the same error
            return None
        run = self.binaries.keep(call, device, compiled, len(args), grid)
        if run is not None:
            self.ahead += 1
        return run

    def _jit(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.jitted += 1
        return self.jit[grid](*args, **kwargs)

    def _runner(self, compiled: Any, grid: tuple[Any, ...], n_args: int,
                kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...], Any] | None:
        """The compiled kernel's launcher for `grid`, the constexpr values that
        follow the positional arguments, and the kernel; None when the call cannot
        be replayed so."""
        tail = (self.params or [])[n_args:]
        # The launcher takes every parameter in order, constexprs included (it
        # ignores their values, compiled in). Positional ones, constexprs too, are in
        # the key by value; those after them must be constexprs passed by name.
        if not all(constexpr and name in kwargs for name, constexpr in tail):
            return None  # a default left to the JIT, or a run-time value by name
        if not hasattr(compiled, "function") or not hasattr(compiled, "__getitem__"):
            return None
        grid3 = grid + (1,) * (3 - len(grid))  # the launcher reads three dims
        try:
            run = compiled[grid3]  # also loads the binary (function, packed_metadata)
        except Exception:  # noqa: BLE001 - an unknown Triton: the JIT keeps every call
            return None
        raw = _raw_launch(compiled, grid3, run, self.device())
        return raw or run, tuple(kwargs[name] for name, _ in tail), compiled


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would do anything: Triton 3.6+ keeps a chain of them,
    empty unless a profiler added one."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Triton versions whose CompiledKernel launches as `_raw_launch` does (read in their
# compiler.py: CompiledKernel.__getitem__); others launch through that runner.
RAW_VERSIONS = ((3, 6), (3, 9))


def _raw_launch(compiled: Any, grid: tuple[Any, ...], runner: Callable[..., Any],
                device: int) -> Callable[..., Any] | None:
    """What Triton's `compiled[grid]` runner does, minus looking up the device,
    the stream and launch metadata each call (a few us). With a launch hook set
    (a profiler such as proton), the runner does it all."""
    try:
        import triton  # optional, and seconds to import: on first use
        from triton import knobs

        version = tuple(int(p) for p in triton.__version__.split(".")[:2])
        if not RAW_VERSIONS[0] <= version <= RAW_VERSIONS[1] or not torch.cuda.is_available():
            return None
        hooks = knobs.runtime
        function, metadata, run = compiled.function, compiled.packed_metadata, compiled.run
        stream = torch._C._cuda_getCurrentRawStream
    except (ImportError, AttributeError, ValueError):
        return None
    g0, g1, g2 = grid

    def launch(*args: Any) -> None:
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            runner(*args)
        else:
            run(g0, g1, g2, stream(device), function, metadata, None, None, None, *args)

    return launch
