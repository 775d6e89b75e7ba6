"""How a launcher is made from a kernel's source: `KernelRecipe`.

A recipe (target, source, launcher class name, fast-math flag) is what the graph
cache (runtime/graph_cache.py) stores of a kernel, so that a later process makes
the same launcher again without rendering anything. The launcher classes are
those the kinds name (kinds/*.py: `launchers`): runtime/launch.py and
runtime/reduction_launch.py define them, `LAUNCHERS` lists them by name.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kinds.spec import KernelSpec
from . import ahead, launch, reduction_launch, static_launch
from .autotune import tuned
from .build import build_cpp, load_triton, triton_module
from .launch import Launcher, Result
from .triton_direct import DirectKernel

LAUNCHERS: dict[str, type[Launcher]] = {c.__name__: c for c in (
    launch.CppLauncher, launch.TritonLauncher, launch.TiledTritonLauncher,
    launch.RowTritonLauncher, launch.LoopedRowTritonLauncher, launch.MultiRowTritonLauncher,
    launch.MatmulLauncher,
    launch.AttentionLauncher, reduction_launch.ReductionCppLauncher,
    reduction_launch.ReductionTritonLauncher)}


@dataclass(frozen=True)
class KernelRecipe:
    """How a launcher was made: enough to make it again in another process (the
    graph cache, runtime/graph_cache.py), from the kernel's source alone."""

    target: str  # triton | openmp
    source: str
    launcher: str  # the Launcher class's name
    # fast_math: let the compiler fuse `a*b + c` into one FMA (C++ -ffp-contract=fast,
    # Triton's enable_fp_fusion); off, each operation rounds as ATen's does.
    contract: bool = False

    def build(self, spec: KernelSpec, fallback: Callable[..., Result],
              lazy: bool = False) -> tuple[Launcher, Path]:
        """The launcher. `lazy` (a recipe that built before, in the graph cache)
        imports the Triton module only when a launch needs Triton's JIT."""
        cls: Any = _launcher_type(self.launcher)
        symbol = spec.symbol_in(self.source)
        if self.target == "triton":
            path = triton_module(self.source)
            fn = _direct(self.source, path, symbol, lazy, self.contract)
            if spec.autotune:  # mode max-autotune: the main kernel's config is timed
                fn = tuned(fn, spec, self.source)
            if self.launcher == "ReductionTritonLauncher":
                combine = _direct(self.source, path, f"{symbol}_combine", lazy,
                                  self.contract)
                launcher = cls(spec, fn, combine, fallback)
            else:
                launcher = cls(spec, fn, fallback)
            if fn.binaries is not None and launch._EMPTY_STRIDED_CUDA is not None:
                launcher.plans = {}  # compiled kernels on a GPU: see Launcher._learn
        else:
            fn, path = build_cpp(self.source, symbol, self.contract)
            launcher = cls(spec, fn, fallback)
        launcher.recipe = self
        return launcher, path


def _direct(source: str, path: Path, symbol: str, lazy: bool, contract: bool
            ) -> DirectKernel:
    """Kernel `symbol` of `source` (written to `path`), launched through its compiled
    binary after its first call, and through a binary stored by an earlier process
    or compiled by the compile worker where one is (static_launch.py, ahead.py).
    While the worker runs, the kernel is imported (and Triton with it) only if a
    launch needs the JIT after all."""
    key = (str(path), symbol, lazy, contract)
    shared = _SHARED.get(key)
    if shared is not None:
        return shared
    kernel = _new_direct(source, path, symbol, lazy, contract)
    _SHARED[key] = kernel
    return kernel


# The DirectKernels of this process by module file, symbol and options: groups that
# compute the same thing (the same source) launch one kernel object, so its binary is
# compiled, found and learned once. Weak: a kernel goes with the last graph using it.
_SHARED: weakref.WeakValueDictionary[tuple[str, str, bool, bool], DirectKernel] = \
    weakref.WeakValueDictionary()


def _new_direct(source: str, path: Path, symbol: str, lazy: bool, contract: bool
                ) -> DirectKernel:
    binaries = None
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and static_launch.available():
        binaries = static_launch.Binaries(source, symbol)
        if not lazy:
            lazy = ahead.running()
    # Triton fuses multiply-adds unless told not to (Inductor too, unless it emulates
    # eager's precision): every launch passes the choice, so it is in every call key
    options = triton_options(source, contract)
    if lazy:
        return DirectKernel(load=lambda: load_triton(path, symbol), binaries=binaries,
                            path=path, symbol=symbol, options=options)
    return DirectKernel(load_triton(path, symbol), binaries=binaries, path=path, symbol=symbol,
                        options=options)


def triton_options(source: str, contract: bool) -> dict[str, Any]:
    """The compile options every launch of a kernel of `source` passes: whether
    multiply-adds fuse, and for a kernel that asserts on the device (a take's
    index: kinds/indexed.py) Triton's `debug`, without which its asserts compile to
    nothing, and no overflow checks of its own (as Inductor compiles its gathers)."""
    options: dict[str, Any] = {"enable_fp_fusion": contract}
    if "tl.device_assert(" in source:
        options.update(debug=True, sanitize_overflow=False)
    return options


def _launcher_type(name: str) -> type[Launcher]:
    """The launcher class a kind names (kinds/*.py: `launchers`)."""
    return LAUNCHERS[name]
