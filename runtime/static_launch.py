"""Compiled Triton kernels kept on disk and launched without Triton.

Triton's JIT compiles a kernel at its first launch for each argument
signature. A later process launching the same kernel on the same signature (a
graph loaded from the graph cache, runtime/graph_cache.py) would import
Triton, start its driver, specialize the arguments and look the binary up in
Triton's cache: about 0.3 s of a 0.5 s warm compile on an H100 host. So once
the JIT has compiled a kernel, `Binaries.keep` stores its binary (cubin) and
what a launch needs (symbol, warps, shared memory, the C type of each argument
the binary takes) in rewritec's cache, and `Binaries.find` hands a later
process a launcher for it through torch's static CUDA launcher (the one
Inductor launches its kernels with), without importing Triton.

A binary is found only under the key it was stored with: the kernel's source,
the call signature (runtime/triton_direct.py: `_signature`, finer than
Triton's specialization), the constexpr and launch options, the device's
compute capability, a fingerprint of Triton's installed files and the TRITON_*
settings. Each file is checked against its recorded hash and this user's key
(runtime/disk_cache.py) before it is loaded.
Kernels that need what the static launcher does not do (clusters, cooperative
or PDL launches, tensor descriptors, scratch memory) are not stored and keep
Triton's JIT. Any failure to store or load only means the JIT launches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .disk_cache import read_verified, store, subdir, verified
from .triton_startup import installed_fingerprint

# Triton's scalar types as torch's static launcher reads them (its own codes).
ARG_CODES = {"i32": "i", "i64": "l", "u32": "I", "u64": "K", "fp32": "f", "f32": "f",
             "fp64": "d"}


def available() -> bool:
    """Whether this torch has the static CUDA launcher and a GPU to launch on."""
    return hasattr(torch._C, "_StaticCudaLauncher") and torch.cuda.is_available()


def describe(compiled: Any, n_args: int) -> tuple[dict[str, Any], bytes] | None:
    """What launching `compiled` takes, for a call with `n_args` positional
    arguments (the rest constexprs by name), and its cubin; None if the static
    launcher cannot launch it."""
    try:
        meta = compiled.metadata
        names = list(compiled.src.fn.arg_names)
        signature = compiled.src.signature
        cubin = compiled.asm["cubin"]
    except (AttributeError, KeyError, TypeError):
        return None
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) \
            or getattr(meta, "launch_pdl", False) or getattr(meta, "tensordesc_meta", None) \
            or getattr(meta, "tmem_size", 0) or tuple(getattr(meta, "cluster_dims", (1, 1, 1))
                                                      ) not in ((1, 1, 1), (1,), ()):
        return None
    keep: list[int] = []
    codes = ""
    for i, name in enumerate(names):
        kind = signature.get(name, "constexpr") if isinstance(signature, dict) else None
        if kind is None:
            return None
        if kind == "constexpr":  # compiled in (declared, or an int equal to 1)
            continue
        if i >= n_args:
            return None  # a run-time value not passed positionally
        code = "O" if kind.startswith("*") else ARG_CODES.get(kind)
        if code is None:
            return None
        keep.append(i)
        codes += code
    # Triton adds a pointer parameter per scratch space its metadata names; none is
    # allocated when its size is 0, so the launch passes a null pointer.
    extra = 0
    for field in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, field):
            if getattr(meta, field):
                return None
            extra += 1
    return {"name": meta.name, "num_warps": int(meta.num_warps), "shared": int(meta.shared),
            "codes": codes + "O" * extra, "keep": keep, "extra": extra,
            "cubin": hashlib.sha256(cubin).hexdigest()}, cubin


@cache
def _fingerprint() -> str:
    """Triton's installed files (paths, sizes, modification times) and TRITON_*
    settings, read without importing Triton."""
    spec = importlib.util.find_spec("triton")
    h = hashlib.sha256(torch.__version__.encode())
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        h.update(installed_fingerprint(root, "").encode())
    for name in sorted(os.environ):
        if name.startswith("TRITON_") and not name.endswith(("_DIR", "_HOME")):
            h.update(f"{name}={os.environ[name]}\n".encode())
    return h.hexdigest()


def _root() -> Path:

    return subdir("binaries")


class Binaries:
    """The stored binaries of one kernel (one `@triton.jit` function of one source)."""

    def __init__(self, source: str, symbol: str) -> None:
        self.kernel = hashlib.sha256(f"{symbol}\0{source}".encode()).hexdigest()
        self.failed: str | None = None  # why nothing more is stored or found
        # the key each call's binary is stored under, this process (what a package
        # of this kernel holds: runtime/package.py)
        self.calls: dict[tuple[Any, ...], str] = {}

    def _key(self, call: tuple[Any, ...], device: int) -> str:
        major, minor = torch.cuda.get_device_capability(device)
        text = f"{self.kernel}\n{major}.{minor}\n{_fingerprint()}\n{call!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def keep(self, call: tuple[Any, ...], device: int, compiled: Any, n_args: int,
             grid: tuple[int, ...] | None = None) -> Callable[..., None] | None:
        """Store the binary the JIT compiled for `call` (kwargs and signature); with
        `grid`, also return a launcher of it (None where it cannot be stored)."""
        if self.failed is not None:
            return None
        try:
            described = describe(compiled, n_args)
            if described is None:
                return None
            meta, cubin = described
            root, key = _root(), self._key(call, device)
            if not verified(root / f"{key}.json"):
                store(root / f"{key}.cubin", cubin)
                store(root / f"{key}.json", json.dumps(meta).encode())
            self.calls[call] = key
            if grid is None:
                return None
            # the binary in hand is the one stored: no need to read it back
            return launcher(meta, str(root / f"{key}.cubin"), device, grid)
        except Exception as e:  # noqa: BLE001 - storing is an optimization, never a failure
            self.failed = f"{type(e).__name__}: {e}"
            return None

    def find(self, call: tuple[Any, ...], device: int, grid: tuple[int, ...]
             ) -> Callable[..., None] | None:
        """A launcher of the stored binary for `call` on `grid`, or None."""
        if self.failed is not None:
            return None
        try:
            root, key = _root(), self._key(call, device)
            path, cubin = root / f"{key}.json", root / f"{key}.cubin"
            described, binary = read_verified(path), read_verified(cubin)
            if described is None or binary is None:  # absent, damaged or not this user's
                return None
            meta = json.loads(described)
            if hashlib.sha256(binary).hexdigest() != meta["cubin"]:
                return None
            self.calls[call] = key
            return launcher(meta, str(cubin), device, grid)
        except Exception as e:  # noqa: BLE001 - a binary that does not load: the JIT
            self.failed = f"{type(e).__name__}: {e}"
            return None


def stored(key: str) -> tuple[dict[str, Any], bytes] | None:
    """What `Binaries.keep` stored under `key`: the launch's description and the
    binary, each checked (runtime/disk_cache.py); None if either is not there."""
    root = _root()
    described, binary = read_verified(root / f"{key}.json"), read_verified(root / f"{key}.cubin")
    if described is None or binary is None:
        return None
    meta = json.loads(described)
    return (meta, binary) if hashlib.sha256(binary).hexdigest() == meta["cubin"] else None


def launcher(meta: dict[str, Any], cubin: str, device: int, grid: tuple[int, ...]
              ) -> Callable[..., None]:
    launcher = torch._C._StaticCudaLauncher
    # (function, registers, spills), or (module, function, registers, spills)
    function = launcher._load_kernel(cubin, meta["name"], meta["shared"], device)[-3]
    run = launcher._launch_kernel
    stream = torch._C._cuda_getCurrentRawStream
    g0, g1, g2 = tuple(grid) + (1,) * (3 - len(grid))
    warps, shared, codes = meta["num_warps"], meta["shared"], meta["codes"]
    keep, nulls = meta["keep"], (None,) * meta["extra"]
    if keep == list(range(len(keep))):
        n = len(keep)

        def launch(*args: Any) -> None:
            run(function, g0, g1, g2, warps, shared, codes, args[:n] + nulls, stream(device))
    else:
        def launch(*args: Any) -> None:
            run(function, g0, g1, g2, warps, shared, codes,
                tuple([args[i] for i in keep]) + nulls, stream(device))
    # what a graph plan writes out to launch it without this function
    # (runtime/graph_plans.py: _Writer.launch)
    launch.static = (function, (g0, g1, g2), warps, shared, codes,  # type: ignore[attr-defined]
                     tuple(keep), len(nulls), device)
    return launch
