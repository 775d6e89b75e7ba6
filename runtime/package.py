"""Packages: one compiled exported program in one file, loaded without compiling.

`rewritec.package` (frontend/package.py) exports and compiles a model and hands
the result here; `write` stores it as a zip file and `load` makes it a callable
again. A package holds, each member listed with its sha256 in `manifest.json`:

    manifest.json   format, versions (rewritec, torch, triton, python), the target
                    its kernels were built for, dynamic dims, the members' hashes
    program.json    the compiled graph as data (runtime/program.py): its steps,
                    inputs (user inputs, weights by name, constants), kernels and
                    how the outputs are nested
    exported.txt    the exported program, as text: what was compiled
    wrapper.py      the wrapper the compilation generated, as text (never run:
                    the loader generates the same function from program.json)
    kernels/NAME.cpp, kernels/NAME.so    each OpenMP kernel's source and library
    kernels/NAME.py, kernels/NAME.N.cubin  each Triton kernel's source and binaries
                    (one per launch signature, for the GPU architecture in the target)
    weights/N.bin, constants/N.bin       tensors as raw bytes (metadata in program.json)

Loading imports only this layer and those below it: no TorchDynamo trace, no
AOTAutograd, no rule file, no code generation and no compiler. Nothing in a
package is unpickled or run as Python: tensors are raw bytes, the wrapper is
regenerated from data checked against an allow-list. Triton binaries launch
through torch's static CUDA launcher (runtime/static_launch.py), without Triton;
a call the package holds no binary for, or a launch that fails, runs the kernel's
fused group as ATen calls (a program like the wrapper's). Libraries and binaries are
native code, loaded as they are (as AOTInductor's are): the hashes catch a damaged
file, not a malicious one, so load only packages you trust. A package is refused, with
one PackageError naming the file, when it is truncated, not a package, holds a
member its manifest does not list or one that is not plain data (a pickle), when
a member's hash does not match, or when it was made for another torch version,
Triton version (packages with Triton kernels), CPU target, GPU architecture or device.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.metadata
import json
import math
import platform
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import __version__
from ..aten.dtypes import DTYPES, TORCH_DTYPES
from ..engine.errors import PackageError
from ..kinds.spec import KernelSpec, KInput, KOutput
from . import static_launch
from .build import cxx_flags, target
from .cudagraphs import UNSAFE, CudaGraphRunner, auto_declines
from .graph_plans import planned
from .launch import _EMPTY_STRIDED_CUDA, Launcher, NoLaunch
from .program import Program
from .recipe import LAUNCHERS, triton_options
from .triton_direct import DirectKernel

FORMAT = "rewritec-package"
FORMAT_VERSION = 2
# What a member may be called; nothing else is loaded (a pickle least of all).
MEMBER = re.compile(r"^(manifest\.json|program\.json|exported\.txt|wrapper\.py|"
                    r"kernels/[A-Za-z][A-Za-z0-9_]*\.(cpp|so|py|[0-9]+\.cubin)|"
                    r"(weights|constants)/[0-9]+\.bin)$")


@dataclass(frozen=True)
class SymbolicSize:
    """A kernel spec's size that was symbolic at compile time (a dynamic dim): the
    launchers read sizes from their inputs, and treat this as "not static"."""

    expr: str


# --------------------------------------------------------------------------- target


def versions() -> dict[str, str | None]:
    """The versions a package records; torch (and Triton, for Triton kernels) must match."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"rewritec": __version__, "torch": torch.__version__,
            "triton": version("triton"), "python": platform.python_version()}


def cpu_target(kernels: str, contract: bool = False) -> dict[str, Any]:
    """The CPU target of a package: OpenMP kernels are built with `-march=native`, so
    they run on CPUs of this vendor, model and feature flags (runtime/build.py:
    target) and this machine type."""
    found: dict[str, Any] = {"device": "cpu", "kernels": kernels}
    if kernels == "openmp":  # ATen alone runs anywhere this torch does
        found["machine"] = f"{platform.machine()}-{sys.platform}"
        found["cpu"] = target()
        found["flags"] = list(cxx_flags(contract))
    return found


def device_target(device: str, kernels: str) -> dict[str, Any]:
    if device == "cpu":
        return cpu_target(kernels)
    found = {"device": device, "kernels": kernels}
    if kernels == "triton":  # binaries for this architecture (sm_90: compute capability 9.0)
        found["arch"] = gpu_arch()
        found["gpu"] = torch.cuda.get_device_name()
    return found


def gpu_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


# --------------------------------------------------------------------------- write


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's values as raw bytes, in row-major order."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    if t.dtype not in DTYPES:
        raise PackageError(f"a tensor of dtype {t.dtype}, which packages do not store")
    return {"dtype": DTYPES[t.dtype],
            "shape": list(t.shape), "stride": list(t.stride()), "device": str(t.device)}


def plain(x: Any) -> Any:
    """A kernel spec's value as JSON (tuples, dicts and symbolic sizes tagged)."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, tuple):
        return {"tuple": [plain(v) for v in x]}
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: plain(v) for k, v in x.items()}}
    if hasattr(x, "free_symbols") or isinstance(x, torch.SymInt | SymbolicSize):
        return {"sym": str(getattr(x, "expr", x))}
    raise PackageError(f"a kernel spec holds a {type(x).__name__}, which a package cannot store")


def spec_data(spec: KernelSpec) -> dict[str, Any]:
    """A launcher's spec (without its terms) as JSON."""
    spec = spec.for_launch()
    data = {f.name: plain(getattr(spec, f.name)) for f in fields(spec)
            if f.name not in ("body", "root", "written", "inputs", "outputs")}
    data["inputs"] = [{f.name: plain(getattr(i, f.name)) for f in fields(i)} for i in spec.inputs]
    data["outputs"] = [{f.name: plain(getattr(o, f.name)) for f in fields(o)}
                       for o in spec.outputs]
    return data


def json_bytes(data: Any) -> bytes:
    return json.dumps(data, indent=1, allow_nan=False).encode()


def write(path: str | Path, members: dict[str, bytes], manifest: dict[str, Any]) -> Path:
    """Write the package: `members` (name -> bytes) and the manifest naming their hashes."""
    path = Path(path)
    for name in members:
        if not MEMBER.match(name):
            raise PackageError(f"{path}: a package member may not be called {name!r}")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                "members": {n: hashlib.sha256(b).hexdigest() for n, b in members.items()}}
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
            for name, data in members.items():
                # text is compressed; tensors and binaries are stored as they are, so
                # loading a large model reads its weights without inflating them
                text = name.endswith((".json", ".txt", ".py", ".cpp"))
                z.writestr(name, data, zipfile.ZIP_DEFLATED if text else zipfile.ZIP_STORED)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PackageError(f"cannot write {path}: {e.strerror or e}") from None
    return path


# --------------------------------------------------------------------------- read


def read(path: str | Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and members of the package at `path`, every member checked
    against its hash; PackageError for anything else."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise PackageError(f"{where}: no such file") from None
    except (zipfile.BadZipFile, OSError, ValueError):
        if head == b"PK\x03\x04":
            raise PackageError(f"{where}: truncated or damaged (its zip directory is "
                               "missing or unreadable)") from None
        raise PackageError(f"{where}: not a rewritec package (not a zip file)") from None
    with archive:
        manifest = _manifest(archive, where)
        listed = manifest.get("members")
        if not isinstance(listed, dict):
            raise PackageError(f"{where}: its manifest lists no members")
        members: dict[str, bytes] = {}
        for info in archive.infolist():
            name = info.filename
            if name == "manifest.json":
                continue
            if not MEMBER.match(name):
                raise PackageError(f"{where}: holds {name!r}, which is not plain package "
                                   "data (packages hold JSON, text, raw tensor bytes and "
                                   "kernels; nothing is unpickled)")
            if name not in listed:
                raise PackageError(f"{where}: holds {name!r}, which its manifest does not list")
            members[name] = _member(archive, name, where)
            got = hashlib.sha256(members[name]).hexdigest()
            if got != listed[name]:
                raise PackageError(f"{where}: member {name} was changed: its sha256 is "
                                   f"{got[:16]}..., the manifest says {str(listed[name])[:16]}...")
        missing = sorted(set(listed) - set(members))
        if missing:
            raise PackageError(f"{where}: members missing: {', '.join(missing)}")
    return manifest, members


def _member(archive: zipfile.ZipFile, name: str, where: str) -> bytes:
    try:
        return archive.read(name)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise PackageError(f"{where}: member {name} is damaged ({e})") from None
    except Exception as e:  # noqa: BLE001 - zlib.error and other decompression failures
        raise PackageError(f"{where}: member {name} is damaged ({type(e).__name__})") from None


def _manifest(archive: zipfile.ZipFile, where: str) -> dict[str, Any]:
    try:
        raw = _member(archive, "manifest.json", where) if "manifest.json" in \
            archive.namelist() else None
        manifest = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        raise PackageError(f"{where}: its manifest.json is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PackageError(f"{where}: not a rewritec package (no rewritec manifest.json)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PackageError(f"{where}: package format {manifest.get('format_version')!r}, "
                           f"this rewritec reads format {FORMAT_VERSION}")
    return manifest


def check_compatible(manifest: dict[str, Any], where: str) -> None:
    """Refuse a package made for another torch, Triton, device or CPU target."""
    here = versions()
    made = manifest.get("versions") or {}
    if made.get("torch") != here["torch"]:
        raise PackageError(f"{where}: made for torch {made.get('torch')}, this is torch "
                           f"{here['torch']}")
    tgt = manifest.get("target") or {}
    if tgt.get("kernels") == "triton" and made.get("triton") != here["triton"]:
        raise PackageError(f"{where}: made for Triton {made.get('triton')}, this is Triton "
                           f"{here['triton']}")
    device = str(tgt.get("device"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PackageError(f"{where}: made for {device}, and torch sees no CUDA GPU here")
    if device.startswith("cuda") and "arch" in tgt and tgt["arch"] != gpu_arch():
        raise PackageError(f"{where}: its kernels were built for GPU architecture "
                           f"{tgt['arch']} ({tgt.get('gpu')}), this GPU is {gpu_arch()} "
                           f"({torch.cuda.get_device_name()})")
    if device == "cpu":
        mine = cpu_target(str(tgt.get("kernels")))
        for key, label in (("machine", "machine type"), ("cpu", "CPU target")):
            if key in tgt and tgt[key] != mine.get(key):
                raise PackageError(f"{where}: its kernels were built for {label} {tgt[key]}, "
                                   f"this machine's is {mine.get(key)}")


# --------------------------------------------------------------------------- load


def load(path: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
         cudagraphs: str | bool = "auto") -> Loaded:
    """The package at `path` as a callable (see the module docstring); on CUDA, with
    its calls replayed as CUDA graphs as `cudagraphs` says (`_replayed`)."""
    where = str(path)
    mode = ("on" if cudagraphs else "off") if isinstance(cudagraphs, bool) else cudagraphs
    if mode not in ("auto", "on", "off"):
        raise PackageError(f"{where}: cudagraphs={cudagraphs!r}: give 'auto', 'on' or 'off'")
    manifest, members = read(path)
    check_compatible(manifest, where)
    try:
        data = json.loads(members["program.json"])
    except (KeyError, ValueError, UnicodeDecodeError):
        raise PackageError(f"{where}: program.json is missing or not JSON") from None
    try:
        tensors = {key: _tensor(meta, members, where)
                   for key, meta in data.get("constants", {}).items()}
        kernels = _kernels(data.get("kernels", []), members, tensors, where)
        weights = _weights(data.get("weights", {}), members, state_dict, where)
        if len(data["graph"]["inputs"]) != len(data["inputs"]):
            raise PackageError(f"{where}: program.json is malformed: the graph takes "
                               f"{len(data['graph']['inputs'])} inputs, "
                               f"{len(data['inputs'])} are described")
        fn, source = Program(data["graph"], where).build(kernels, tensors)
        fn = planned(fn, source)
        out_spec = pytree.treespec_loads(data["out_spec"])
        return Loaded(where, manifest, fn, source, data["inputs"], data["user_inputs"],
                      weights, int(data["user_outputs"]), out_spec,
                      _replayed(fn, data, mode, manifest))
    except PackageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError,
            OverflowError) as e:  # RuntimeError: torch refusing a device, shape or stride
        raise PackageError(f"{where}: program.json is malformed: {type(e).__name__}: "
                           f"{e}") from None


def _replayed(fn: Any, data: dict[str, Any], mode: str, manifest: dict[str, Any]
              ) -> CudaGraphRunner | None:
    """The package's wrapper replayed as CUDA graphs (runtime/cudagraphs.py), as a
    compiled inference graph is under `cudagraphs`: on a CUDA package unless `off`,
    never for a program with random ops; under `auto` only where launches are many
    enough to gain (`auto_declines`). Weights are read where they are; each call's
    inputs are copied into the graph's buffers, and a result is never overwritten
    while the caller holds it. None: the plain wrapper."""
    if mode == "off" or manifest.get("target", {}).get("device") != "cuda":
        return None
    ops: dict[str, int] = {}
    for step in data["graph"]["steps"]:
        if "op" in step:
            name = str(step["op"]).split("::")[-1].split(".")[0]
            if any(u in name for u in UNSAFE):
                return None
            ops[name] = ops.get(name, 0) + 1
    kernels = [{"matrix_products": bool(k.get("matrix_products"))}
               for k in data.get("kernels", [])]
    if mode == "auto" and auto_declines(ops, kernels) is not None:
        return None
    params = [slot["kind"] != "user" for slot in data["inputs"]]
    return CudaGraphRunner(fn, params, mode)


def _kernels(entries: list[dict[str, Any]], members: dict[str, bytes],
             tensors: dict[str, torch.Tensor], where: str) -> dict[str, Launcher]:
    """Each kernel's launcher: an OpenMP library loaded from a private temporary
    folder (ctypes loads from a file; the folder goes once they are loaded), or a
    Triton kernel's binaries launched through torch's static launcher; where it
    cannot launch, its group's ATen calls run (a program, checked as the wrapper is)."""
    kernels: dict[str, Launcher] = {}
    if not entries:
        return kernels
    with tempfile.TemporaryDirectory(prefix="rewritec-package-") as tmp:
        for entry in entries:
            spec = _spec(entry["spec"])
            cls = LAUNCHERS.get(entry["launcher"])
            target = entry.get("target")
            if cls is None or target not in ("openmp", "triton") or \
                    cls.__name__.endswith("CppLauncher") != (target == "openmp"):
                raise PackageError(f"{where}: kernel {spec.name} has launcher "
                                   f"{entry.get('launcher')!r} for target {target!r}")
            fallback = _fallback(entry.get("aten"), tensors, where, spec.name)
            if target == "openmp":
                fn = _library(Path(tmp), spec.name, _symbol(spec, entry, members),
                              members[entry["binary"]], where)
                kernels[spec.name] = cls(spec, fn, fallback)
            else:
                kernels[spec.name] = _triton(cls, spec, entry, members, fallback, where)
    return kernels


def _symbol(spec: KernelSpec, entry: dict[str, Any], members: dict[str, bytes]) -> str:
    """The name the kernel's stored source defines it by (kinds/spec.py: symbol_in)."""
    source = members.get(str(entry.get("source")), b"")
    return spec.symbol_in(source.decode(errors="replace"))


def _library(tmp: Path, name: str, symbol: str, data: bytes, where: str) -> Any:
    lib = tmp / f"{name}.so"
    lib.write_bytes(data)
    try:
        return getattr(ctypes.CDLL(str(lib)), symbol)
    except (OSError, AttributeError) as e:
        raise PackageError(f"{where}: kernel {name} does not load: {e}") from None


def _triton(cls: Any, spec: KernelSpec, entry: dict[str, Any], members: dict[str, bytes],
            fallback: Callable[..., Any], where: str) -> Launcher:
    """A Triton kernel's launcher whose every launch runs one of the binaries the
    package holds, launched without Triton: the binary made for this very call, or
    one whose specialization admits it (a dynamic dim's sizes); a call no binary
    admits runs `fallback` (NoBinary: never Triton's JIT)."""
    found: dict[str, list[Binary]] = {}
    paths: dict[str, str] = {}
    for b in entry["binaries"]:
        data = members[b["cubin"]]
        digest = hashlib.sha256(data).hexdigest()
        if digest != b["meta"]["cubin"]:
            raise PackageError(f"{where}: {b['cubin']} is not the binary program.json names")
        if digest not in paths:
            path = _cubin_dir() / f"{digest}.cubin"
            path.write_bytes(data)
            paths[digest] = str(path)
        found.setdefault(str(b["symbol"]), []).append(Binary(
            str(b["call"]), str(b.get("kwargs", "")), _assume(b.get("assume"), where),
            b["meta"], paths[digest]))

    source = members.get(str(entry.get("source")), b"").decode(errors="replace")
    options = triton_options(source, bool(entry.get("contract")))

    def kernel(symbol: str) -> DirectKernel:
        return DirectKernel(load=_no_jit(where, symbol), binaries=PackagedBinaries(
            found.get(symbol, [])), symbol=symbol, options=options)

    spec = replace(spec, autotune=False)  # the binaries are the configurations it chose
    if cls.__name__ == "ReductionTritonLauncher":
        symbol = _symbol(spec, entry, members)
        launcher = cls(spec, kernel(symbol), kernel(f"{symbol}_combine"), fallback)
    else:
        launcher = cls(spec, kernel(_symbol(spec, entry, members)), fallback)
    if _EMPTY_STRIDED_CUDA is not None:
        launcher.plans = {}  # launch plans, as for a graph's compiled kernels (launch.py)
    return launcher  # type: ignore[no-any-return]


# The range of each integer type of torch's static launcher (static_launch.ARG_CODES)
INT_RANGES = {"i": (-2**31, 2**31 - 1), "l": (-2**63, 2**63 - 1), "I": (0, 2**32 - 1),
              "K": (0, 2**64 - 1)}


def assumptions(call: tuple[Any, ...], meta: dict[str, Any]) -> list[list[Any]]:
    """What the binary compiled for `call` (runtime/triton_direct.py: call_key)
    assumes of each positional argument, as Triton specialized it: a value compiled
    in (a constexpr, or an int equal to 1) must be equal; an int must fit the
    binary's integer type and, where it was a multiple of 16 (Triton's divisibility
    hint), stay one; a tensor must keep its dtype and, where it was, its 16-byte
    alignment. Any call these hold for may run the binary: that is how one binary
    serves every size of a dynamic dim. Conservative: an assumption Triton did not
    make only means a call finds no binary."""
    keep, codes = list(meta["keep"]), str(meta["codes"])
    found: list[list[Any]] = []
    for i, arg in enumerate(call[1]):
        code = codes[keep.index(i)] if i in keep else None
        if code in INT_RANGES and type(arg) is int:
            found.append(["int", *INT_RANGES[code], arg % 16 == 0])
        elif code == "O" and isinstance(arg, tuple) and len(arg) == 2 \
                and isinstance(arg[0], torch.dtype):
            found.append(["ptr", str(arg[0]), arg[1] == 0])
        elif code in ("f", "d") and isinstance(arg, tuple) and arg[0] is float:
            found.append(["float"])
        else:
            found.append(["=", repr(arg)])
    return found


def _assume(data: Any, where: str) -> list[list[Any]] | None:
    """A binary's assumptions as program.json gives them, checked for shape."""
    shapes = {"int": (int, int, bool), "ptr": (str, bool), "float": (), "=": (str,)}
    if data is None:
        return None
    if isinstance(data, list) and all(
            isinstance(a, list) and a and a[0] in shapes and len(a) == 1 + len(shapes[a[0]])
            and all(isinstance(v, t) for v, t in zip(a[1:], shapes[a[0]], strict=True))
            for a in data):
        return data
    raise PackageError(f"{where}: program.json is malformed: a binary's assumptions are "
                       f"{str(data)[:80]}")


def admits(assume: list[list[Any]], signature: tuple[Any, ...]) -> bool:
    """Whether a call of this signature holds every assumption of a binary."""
    if len(assume) != len(signature):
        return False
    for want, arg in zip(assume, signature, strict=True):
        how = want[0]
        if how == "int":
            if type(arg) is not int or not want[1] <= arg <= want[2] or \
                    (want[3] and arg % 16):
                return False
        elif how == "ptr":
            if not (isinstance(arg, tuple) and len(arg) == 2 and
                    str(arg[0]) == want[1] and (not want[2] or arg[1] == 0)):
                return False
        elif how == "float":
            if not (isinstance(arg, tuple) and arg[0] is float):
                return False
        elif how != "=" or repr(arg) != want[1]:
            return False
    return True


@dataclass(frozen=True)
class Binary:
    """One of a kernel's packaged binaries: the call it was compiled for, its
    constexprs, what it assumes of each argument (None: only its own call), how to
    launch it and where its cubin is."""

    call: str
    kwargs: str
    assume: list[list[Any]] | None
    meta: dict[str, Any]
    path: str

    def strength(self) -> int:
        """How many divisibility and alignment hints it was compiled with."""
        return sum(1 for a in self.assume or () if a[0] in ("int", "ptr") and a[-1])


class PackagedBinaries:
    """runtime/static_launch.py's Binaries for a package: its binaries, found by
    call (the repr of triton_direct.call_key) or by what each admits, and nothing
    stored."""

    failed: str | None = None

    def __init__(self, binaries: list[Binary]) -> None:
        self.exact = {b.call: b for b in binaries}
        self.binaries = binaries

    def find(self, call: tuple[Any, ...], device: int, grid: tuple[int, ...]
             ) -> Callable[..., None] | None:
        hit = self.exact.get(repr(call))
        if hit is None:
            kwargs = repr(call[0])
            fits = [b for b in self.binaries if b.assume is not None and b.kwargs == kwargs
                    and admits(b.assume, call[1])]
            hit = max(fits, key=Binary.strength, default=None)
        return None if hit is None else static_launch.launcher(hit.meta, hit.path, device, grid)

    def keep(self, *args: Any, **kwargs: Any) -> None:
        return None


class NoBinary(PackageError, NoLaunch):
    """A packaged Triton kernel holds no binary for this call: the call runs through
    the kernel's ATen body (runtime/launch.py: NoLaunch), other calls still launch."""


def _no_jit(where: str, symbol: str) -> Callable[[], Any]:
    def load() -> Any:
        raise NoBinary(f"{where}: kernel {symbol} has no binary for this call: its "
                       "dtypes or alignment differ from the example's, or its sizes "
                       "from every size the package was built with (a dynamic dim's "
                       "sizes choose each kernel's block; see docs/packages.md)")

    return load


_cubins: list[Path] = []


def _cubin_dir() -> Path:
    """Where loaded packages' binaries live while this process runs: torch's static
    launcher loads a binary from a file at its first launch."""
    if not _cubins:
        _cubins.append(Path(tempfile.mkdtemp(prefix="rewritec-package-cubins-")))
        atexit.register(shutil.rmtree, _cubins[0], True)
    return _cubins[0]


def _fallback(program: Any, tensors: dict[str, torch.Tensor], where: str, name: str
              ) -> Callable[..., Any]:
    """What a package kernel runs where it cannot launch: its group's ATen calls, or
    (a package without them) one error, never a wrong result."""
    if program is None:
        def failed(*inputs: Any) -> Any:
            raise PackageError(f"{where}: kernel {name} cannot launch (see the warning) and "
                               "the package holds no ATen body for it")

        return failed
    fn, _ = Program(program, where).build({}, tensors)
    single = len(program["outputs"]) == 1

    def fallback(*inputs: Any) -> Any:
        out = fn(list(inputs))
        return out[0] if single else tuple(out)

    return fallback


def _spec(data: dict[str, Any]) -> KernelSpec:
    values = {k: _unplain(v) for k, v in data.items() if k not in ("inputs", "outputs")}
    if not isinstance(values.get("name"), str) or not re.match(r"^[A-Za-z][A-Za-z0-9_]*$",
                                                               values["name"]):
        raise ValueError(f"kernel name {values.get('name')!r}")
    return KernelSpec(**values, body=[], root=None, written=[],  # type: ignore[arg-type]
                      inputs=[KInput(**{k: _unplain(v) for k, v in i.items()})
                              for i in data["inputs"]],
                      outputs=[KOutput(**{k: _unplain(v) for k, v in o.items()})
                               for o in data["outputs"]])


def _unplain(x: Any) -> Any:
    if isinstance(x, list):
        return [_unplain(v) for v in x]
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "tuple":
        return tuple(_unplain(e) for e in v)
    if tag == "dict":
        return {str(k): _unplain(e) for k, e in v.items()}
    if tag == "sym":
        return SymbolicSize(str(v))
    if tag == "float" and v in ("inf", "-inf", "nan"):
        return float(v)
    raise ValueError(f"a spec value {x!r}")


def _tensor(meta: dict[str, Any], members: dict[str, bytes], where: str) -> torch.Tensor:
    """A stored tensor from its raw bytes: the dtype, shape and strides it had."""
    dtype = TORCH_DTYPES[meta["dtype"]]
    shape, stride = [int(n) for n in meta["shape"]], [int(n) for n in meta["stride"]]
    raw = members[meta["member"]]
    numel = math.prod(shape)
    want = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw) != want:
        raise PackageError(f"{where}: {meta['member']} holds {len(raw)} bytes, "
                           f"{tuple(shape)} {meta['dtype']} needs {want}")
    flat = torch.frombuffer(bytearray(raw), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    out = torch.empty_strided(shape, stride, dtype=dtype, device=meta["device"])
    out.copy_(flat.reshape(shape))
    return out


def _weights(entries: dict[str, dict[str, Any]], members: dict[str, bytes],
             state_dict: dict[str, torch.Tensor] | None, where: str) -> dict[str, torch.Tensor]:
    """The weights by name: stored ones from the package, the rest from `state_dict`
    (each checked to have the shape and dtype the package was compiled for)."""
    found: dict[str, torch.Tensor] = {}
    for name, meta in entries.items():
        if meta.get("member") is not None and (state_dict is None or name not in state_dict):
            found[name] = _tensor(meta, members, where)
            continue
        if state_dict is None or name not in state_dict:
            raise PackageError(f"{where}: weight {name!r} is not in the package (written with "
                               "weights=False) and not in the state_dict given")
        given = state_dict[name]
        want = (tuple(meta["shape"]), TORCH_DTYPES[meta["dtype"]])
        if not isinstance(given, torch.Tensor) or (tuple(given.shape), given.dtype) != want:
            got = (tuple(given.shape), given.dtype) if isinstance(given, torch.Tensor) \
                else type(given).__name__
            raise PackageError(f"{where}: weight {name!r} is {got}, the package needs "
                               f"{want}")
        found[name] = given.detach().to(meta["device"])
    return found


class Loaded:
    """A loaded package, called as the model was: `loaded(*inputs)`."""

    def __init__(self, where: str, manifest: dict[str, Any], fn: Any, source: str,
                 inputs: list[dict[str, Any]], user_inputs: list[dict[str, Any]],
                 weights: dict[str, torch.Tensor], user_outputs: int, out_spec: Any,
                 cudagraphs: CudaGraphRunner | None = None) -> None:
        self.path = where
        self.manifest = manifest
        # runtime/cudagraphs.py's runner of `fn` when calls are replayed as CUDA graphs
        self.cudagraphs = cudagraphs
        self.source = source  # the wrapper, generated from program.json
        self._fn = cudagraphs or fn
        self._user = user_inputs
        self._slots = [None if i["kind"] == "user" else weights[i["name"]] for i in inputs]
        self._user_outputs = user_outputs
        self._out_spec = out_spec
        self._ranges = {k: tuple(v) for k, v in manifest.get("dynamic", {}).items()}
        if sum(s is None for s in self._slots) != len(user_inputs):
            raise PackageError(f"{where}: program.json is malformed: {len(user_inputs)} user "
                               f"inputs described, {sum(s is None for s in self._slots)} taken")

    def __call__(self, *inputs: Any) -> Any:
        self._check(inputs)
        given = iter(inputs)
        args = [next(given) if s is None else s for s in self._slots]
        with torch.no_grad():
            flat = list(self._fn(args))
        flat = flat[len(flat) - self._user_outputs:] if self._user_outputs else []
        return pytree.tree_unflatten(flat, self._out_spec)

    def _check(self, inputs: tuple[Any, ...]) -> None:
        """Inputs as the package was compiled for: count, dtype, device, static dims
        equal, dynamic dims within their range and equal where they share a name."""
        if len(inputs) != len(self._user):
            raise PackageError(f"{self.path}: takes {len(self._user)} inputs, got {len(inputs)}")
        seen: dict[str, int] = {}
        for k, (x, want) in enumerate(zip(inputs, self._user, strict=True)):
            if not isinstance(x, torch.Tensor):
                raise PackageError(f"{self.path}: input {k} is a {type(x).__name__}, "
                                   "the package takes tensors")
            dtype = DTYPES.get(x.dtype, str(x.dtype))
            if dtype != want["dtype"] or str(x.device) != want["device"] or \
                    x.dim() != len(want["shape"]):
                raise PackageError(f"{self.path}: input {k} is {tuple(x.shape)} {x.dtype} on "
                                   f"{x.device}, the package takes {self._shape_text(want)} "
                                   f"{TORCH_DTYPES.get(want['dtype'])} on {want['device']}")
            for d, (n, size) in enumerate(zip(x.shape, want["shape"], strict=True)):
                self._check_dim(k, d, n, size, seen)

    def _check_dim(self, k: int, d: int, n: int, size: Any, seen: dict[str, int]) -> None:
        if isinstance(size, int):
            if n != size:
                raise PackageError(f"{self.path}: input {k} has size {n} in dim {d}, the "
                                   f"package was compiled for {size} (dims declared dynamic "
                                   "at export, dynamic_shapes=, may vary)")
            return
        name = size["sym"]
        low, high = self._ranges.get(name, (0, None))
        if n < low or (high is not None and n > high):
            raise PackageError(f"{self.path}: input {k} has size {n} in dim {d}, dynamic dim "
                               f"{name} takes {low}..{'' if high is None else high}")
        if seen.setdefault(name, n) != n:
            raise PackageError(f"{self.path}: input {k} has size {n} in dim {d}, but dim "
                               f"{name} is {seen[name]} in an earlier input")

    @staticmethod
    def _shape_text(want: dict[str, Any]) -> str:
        return "(" + ", ".join(str(s) if isinstance(s, int) else s["sym"]
                               for s in want["shape"]) + ")"
