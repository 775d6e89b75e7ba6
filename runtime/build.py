"""Building and loading generated kernels, through an on-disk cache.

- C++ (OpenMP): compiled with the system compiler (`$CXX`, default g++) as
  `-O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC` and loaded with
  ctypes (no multiply-add contraction, so results round as ATen's, unless fast_math).
  A compiler that rejects -fopenmp (Apple's clang) builds without it, single-threaded,
  after one `NoOpenMPWarning`.
- Triton: the source is written to a file (Triton's JIT reads it back) and
  imported; `@triton.jit` compiles it on first launch.

The cache (`$REWRITEC_CACHE_DIR`, default `~/.cache/rewritec`; what is trusted
in it: runtime/disk_cache.py) is keyed by the sha256 of source, flags, compiler
and the target CPU (`target`); beside each artifact a `.sha256` file holds its
hash, target and this user's HMAC of both, and an artifact that does not match
is rebuilt, never loaded. Writers build into a private temporary file and
publish with an atomic rename, so processes filling the cache at once never see
half a file. A graph's builds share a compile budget (`budget`): a compiler that
never returns costs that much once, and the graph's remaining groups fall back.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Any

from ..engine.diag import user_stacklevel
from . import triton_startup
from .disk_cache import cache_dir, configured_root, give_up, publish, read_verified, store, verified

# -fno-math-errno: kernels never read errno, and calls that may set it cannot vectorize.
# -fno-builtin-sin/cos: GCC merges sin(x) and cos(x) of one x into a scalar
# sincosf, which libmvec cannot vectorize (sin(x)^2 + cos(x)^2 ran 3x slower than
# eager); kernels call sinf/cosf by name instead (kinds/kernels.py: PLAIN_CALLS).
# -ffp-contract=off: GCC otherwise fuses `a*b + c` into one FMA, rounded once where
# ATen rounds twice (1 ulp off, and `b + 2*a` finite where eager overflows to inf);
# `fast_math` kernels may contract (CONTRACT_FLAG replaces it).
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
             "-fno-builtin-sinf", "-fno-builtin-cosf", "-fno-builtin-sin", "-fno-builtin-cos",
             "-shared", "-fPIC", "-std=c++17")
CONTRACT_FLAG = "-ffp-contract=fast"
# Not builtins under CXX_FLAGS: their declarations must say that they only
# compute (const) for the vectorizer to call their libmvec versions.
PURE_CALLS = ("sinf", "cosf", "sin", "cos")

# glibc's vector math library (libmvec) has SIMD versions of these. Declaring
# them `simd` lets the vectorizer call them, as -ffast-math would, but without
# fast-math's license to ignore inf, nan and signed zeros.
VECTOR_MATH = ("float expf(float)", "float logf(float)", "float sinf(float)",
               "float cosf(float)", "float erff(float)", "float tanhf(float)",
               "float log1pf(float)", "float expm1f(float)", "float powf(float, float)",
               "double exp(double)", "double log(double)", "double sin(double)",
               "double cos(double)", "double erf(double)", "double tanh(double)",
               "double pow(double, double)")


class BuildError(Exception):
    """A kernel could not be built; its group falls back to ATen."""


class NoOpenMPWarning(UserWarning):
    """The C++ compiler rejects -fopenmp: kernels are built single-threaded."""


class BudgetSpent(BuildError):
    """The graph's compile budget ran out; this group and the rest fall back."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_publish = publish


def _verified(path: Path) -> bool:
    """A kernel artifact in the cache vouched for: a library built for this CPU
    (`target`), or a Triton module."""
    return verified(path, target() if path.suffix == ".so" else "")


@cache
def cxx() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    name = os.environ.get("CXX", "g++")
    return shutil.which(name)


@cache
def _cxx_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return compiler


@cache
def target() -> str:
    """What `-march=native` builds for on this machine: the CPU's vendor, family,
    model and feature flags (from /proc/cpuinfo; the machine name elsewhere), as a
    short hash. It is part of every kernel's key and recorded beside its library,
    so a cache shared between machines never loads a library built for another
    CPU (it would die of SIGILL on an instruction this one lacks)."""
    fields = {"vendor_id", "cpu family", "model", "flags", "isa", "cpu model", "features",
              "cpu implementer", "cpu architecture", "cpu variant", "cpu part"}
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                name, _, value = line.partition(":")
                if name.strip().lower() in fields:
                    lines.append(f"{name.strip()}={value.strip()}")
    except OSError:
        lines.append(platform.processor())
    return _sha("\n".join(lines).encode())[:16]


# What is left of the current graph's compile budget (see `budget`).
_deadline: ContextVar[float | None] = ContextVar("rewritec_build_deadline", default=None)
# The longest one build may take, budget or not.
BUILD_TIMEOUT_S = 300.0


@contextmanager
def budget(seconds: float | None) -> Iterator[None]:
    """Builds inside share `seconds` of compiler time; once spent, the rest fail
    at once (their groups fall back to ATen) instead of each waiting out a
    compiler that never returns."""
    token = _deadline.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def _time_left() -> float:
    deadline = _deadline.get()
    if deadline is None:
        return BUILD_TIMEOUT_S
    left = min(BUILD_TIMEOUT_S, deadline - time.monotonic())
    if left <= 0:
        raise BudgetSpent("the graph's compile budget is spent (REWRITEC_COMPILE_BUDGET)")
    return left


_vector_math: tuple[str, ...] | None = None


def vector_math_decls() -> tuple[str, ...]:
    """The `simd` declarations of VECTOR_MATH, if this machine's libmvec has them
    (probed once: a kernel that fails to load would otherwise fall back). A probe
    cut short by the compile budget is tried again by the next graph."""
    global _vector_math
    if _vector_math is not None:
        return _vector_math

    def attrs(decl: str) -> str:
        name = decl.split("(")[0].split()[-1]
        return '"notinbranch"), const, nothrow' if name in PURE_CALLS else '"notinbranch")'

    decls = tuple(f'__attribute__((simd({attrs(d)})) {d};' for d in VECTOR_MATH)
    probe = ("#include <cmath>\n#include <cstdint>\nextern \"C\" {\n" + "\n".join(decls)
             + "\n}\nextern \"C\" void probe(float* a, double* b, int64_t n) {\n"
             "#pragma omp simd\nfor (int64_t i = 0; i < n; ++i) a[i] = std::exp(a[i]) + "
             "std::log(a[i]) + std::sin(a[i]) + std::cos(a[i]) + std::erf(a[i]) + "
             "std::tanh(a[i]) + std::log1p(a[i]) + std::expm1(a[i]) + std::pow(a[i], a[i]);\n"
             "#pragma omp simd\nfor (int64_t i = 0; i < n; ++i) b[i] = std::exp(b[i]) + "
             "std::log(b[i]) + std::sin(b[i]) + std::cos(b[i]) + std::erf(b[i]) + "
             "std::tanh(b[i]) + std::pow(b[i], b[i]);\n}\n")
    try:
        build_cpp(probe, "probe")
    except BudgetSpent:
        return ()
    except BuildError:
        _vector_math = ()
        return ()
    _vector_math = decls
    return decls


def cxx_flags(contract: bool = False) -> tuple[str, ...]:
    """The compiler flags; `contract` (fast_math) lets GCC fuse multiply-adds."""
    flags: tuple[str, ...] = CXX_FLAGS
    if _openmp.get(cxx() or "") is False:
        flags = tuple(f for f in flags if f != "-fopenmp")
    if not contract:
        return flags
    return tuple(CONTRACT_FLAG if f == "-ffp-contract=off" else f for f in flags)


# Whether each C++ compiler accepts -fopenmp (Apple's clang does not), as probed
# after its first failed build; one that does not builds without it.
_openmp: dict[str, bool] = {}


def _drop_openmp_if_rejected(compiler: str) -> bool:
    """After a failed build: if `compiler` rejects -fopenmp itself, build without it
    from now on, after one warning, instead of every kernel falling back. True if
    it was dropped now (so the build is worth trying again)."""
    if compiler in _openmp:
        return False
    with tempfile.TemporaryDirectory(prefix="rewritec-omp-") as tmp:
        src = Path(tmp, "probe.cpp")
        src.write_text('extern "C" int probe() { return 0; }\n')
        try:
            _compile(compiler, ["-fopenmp", "-shared", "-fPIC", str(src), "-o",
                                str(Path(tmp, "probe.so"))])
            _openmp[compiler] = True
            return False
        except BudgetSpent:
            return False  # not known yet
        except BuildError:
            _openmp[compiler] = False
    warnings.warn(f"rewritec: {compiler} does not accept -fopenmp; CPU kernels are built "
                  "without OpenMP and run on one thread (set CXX to a compiler with "
                  "OpenMP for parallel kernels)", NoOpenMPWarning,
                  stacklevel=user_stacklevel())
    return True


def build_cpp(source: str, symbol: str, contract: bool = False) -> tuple[Any, Path]:
    """Compile (or fetch from the cache) and return (the C function, source path).
    `contract` allows FMA contraction (fast_math); off, results round as ATen's."""
    compiler = cxx()
    if compiler is None:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    try:
        lib, src = _build_cached(source, compiler, cxx_flags(contract))
    except BudgetSpent:
        raise
    except BuildError:
        if not _drop_openmp_if_rejected(compiler):
            raise
        lib, src = _build_cached(source, compiler, cxx_flags(contract))
    try:
        fn = getattr(ctypes.CDLL(str(lib)), symbol)
    except (OSError, AttributeError) as e:
        raise BuildError(f"cannot load {lib.name}: {e}") from None
    return fn, src


# C++ libraries found built in the cache, this process (the report's cache hits)
CACHE_HITS = [0]


def _build_cached(source: str, compiler: str, flags: tuple[str, ...]) -> tuple[Path, Path]:
    """The library built from `source` with `flags`, and its source, in the cache."""
    key = _sha("\n".join([source, " ".join(flags), _cxx_version(compiler), target()]).encode())
    try:
        root = cache_dir()
        lib = _build_into(root, key, source, compiler, flags)
    except OSError as e:  # the cache folder cannot be written (full disk, removed)
        try:
            root = give_up(configured_root(), e.strerror or str(e))
            lib = _build_into(root, key, source, compiler, flags)
        except OSError as e:
            raise BuildError(f"cannot write the kernel: {e.strerror or e}") from None
    return lib, root / f"{key}.cpp"


def _build_into(root: Path, key: str, source: str, compiler: str, flags: tuple[str, ...]
                ) -> Path:
    """The verified library of `key` in `root`, built there first if need be; the
    temporary files go, whatever happens."""
    src, lib = root / f"{key}.cpp", root / f"{key}.so"
    if verified(lib, target()):
        CACHE_HITS[0] += 1
        return lib
    fd, tmp_name = tempfile.mkstemp(suffix=".so", prefix=f".{key}.", dir=root)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp_src = tmp.with_suffix(".cpp")
    try:
        tmp_src.write_text(source)
        _compile(compiler, [*flags, str(tmp_src), "-o", str(tmp)])
        if not src.exists():
            os.replace(tmp_src, src)
        publish(tmp, lib, target())
    finally:
        tmp.unlink(missing_ok=True)
        tmp_src.unlink(missing_ok=True)
    return lib


def _compile(compiler: str, args: list[str]) -> None:
    """Run the compiler within what is left of the budget; on a timeout, its whole
    process group goes (g++ leaves cc1plus running otherwise)."""
    limit = _time_left()
    try:
        proc = subprocess.Popen([compiler, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        raise BuildError(f"{compiler} failed to run: {e}") from None
    try:
        _, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        deadline = _deadline.get()
        if deadline is not None and deadline - time.monotonic() <= 0:
            raise BudgetSpent(f"{compiler} ran past the graph's compile budget "
                              f"(REWRITEC_COMPILE_BUDGET)") from None
        raise BuildError(f"{compiler} did not finish within {limit:.0f} s") from None
    if proc.returncode != 0:
        if "No space left on device" in stderr:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        first = "\n".join(stderr.strip().splitlines()[:6])
        raise BuildError(f"{compiler} rejected the kernel:\n{first}")


def triton_module(source: str) -> Path:
    """Write (or reuse) the module file of a Triton kernel's source; Triton's JIT
    reads its kernels' source back from their file."""
    key = _sha(source.encode())
    try:
        return _module_into(cache_dir(), key, source)
    except OSError as e:  # the cache folder cannot be written (full disk, removed)
        try:
            return _module_into(give_up(configured_root(), e.strerror or str(e)), key, source)
        except OSError as e:
            raise BuildError(f"cannot write the kernel: {e.strerror or e}") from None


def _module_into(root: Path, key: str, source: str) -> Path:
    path = root / f"{key}.py"
    if read_verified(path) != source.encode():
        store(path, source.encode())
    return path


def load_triton(path: Path, symbol: str) -> Any:
    """The @triton.jit kernel `symbol` of the module file `triton_module` wrote."""
    from .compile_worker import load_module  # imports Triton: only a Triton kernel's build

    triton_startup.wait()  # a start-up begun by the backend finishes first
    try:
        module = load_module(f"rewritec_kernels.{symbol}_{path.stem[:12]}", path)
    except Exception as e:  # noqa: BLE001 - a template that renders invalid code
        raise BuildError(f"generated Triton module does not load: {type(e).__name__}: "
                         f"{e}") from None
    return getattr(module, symbol)
