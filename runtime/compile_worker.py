"""The compile worker: a child process that compiles Triton kernels for rewritec.

Run as a script (`python compile_worker.py`) by runtime/ahead.py; it imports
neither torch nor rewritec (it keeps torch out: `NoTorch`), so it is ready in the
time Triton takes to import.
While the parent's TorchDynamo traces and its rules rewrite, the worker imports
Triton's compiler and compiles a small kernel once (Triton's first compile in a
process pays for its own start-up); once the parent has rendered a kernel and
knows the arguments of its first launch, the worker compiles it on another core.

Protocol, one JSON object a line. The parent first writes
    {"triton_key": str | null, "imports": [module, ...], "warm": [backend, arch, warp_size] | null}
and the worker answers {"ready": true}. Then each job
    {"id": int, "path": str, "symbol": str, "target": [backend, arch, warp_size],
     "args": [...], "kwargs": {...}}
where an argument is {"int": n}, {"float": x}, {"bool": b}, {"none": null} or
{"tensor": "float32", "align": address % 16}, is answered by
    {"id": int, "ok": true, "metadata": {...}, "arg_names": [...],
     "signature": {...}, "cubin": base64}     or     {"id": int, "ok": false, "error": str}.
The worker compiles through the kernel's own JIT (`warmup`), so the arguments are
specialized exactly as a launch would specialize them. It exits when its input
closes.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import select
import sys
import tempfile
from pathlib import Path
from typing import Any

# A kernel small enough to compile fast, using what every generated kernel uses.
WARM_SOURCE = '''\
import triton
import triton.language as tl


@triton.jit
def rewritec_warm(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, tl.sigmoid(x) * x, mask=mask)
'''


class DType:
    """A torch dtype as Triton reads one off a tensor: by its name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


# One DType a name, alive for the process: Triton's specialization caches what it
# reads off a dtype by the object's identity, as torch's dtypes are singletons.
_DTYPES: dict[str, DType] = {}


class Pointer:
    """A tensor argument: its dtype and its address modulo 16, all that Triton's
    specialization reads of it."""

    def __init__(self, dtype: str, align: int) -> None:
        self.dtype = _DTYPES.setdefault(dtype, DType(dtype))
        self.align = align

    def data_ptr(self) -> int:
        return self.align


class TargetDriver:
    """Triton's active driver, reduced to what compiling needs: the target. The
    parent, which has the GPU, says which target each job is for."""

    def __init__(self) -> None:
        self.target: Any = None

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def is_active(self) -> bool:
        return True


class NoTorch:
    """An import finder that says torch is not installed. Triton's argument
    specialization (native_specialize_impl, Triton 3.6) imports torch where it can,
    to know its tensors: over a second in a CUDA build, before the first job
    compiles. The worker's arguments are stand-ins, so torch stays out; Triton then
    specializes them as where torch is not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"no module named {name!r} in the compile worker",
                                      name=name)


def decode(arg: dict[str, Any]) -> Any:
    (kind, value), = ((k, v) for k, v in arg.items() if k != "align")
    if kind == "tensor":
        return Pointer(value, int(arg.get("align", 0)))
    if kind in ("int", "float", "bool", "none"):
        return value
    raise ValueError(f"unknown argument kind {kind!r}")


def load_module(name: str, path: str | Path) -> Any:
    """The module file at `path`, imported once under `name` (also how the parent
    loads a kernel for Triton's JIT: runtime/build.py, load_triton)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return module


def _load(path: str, symbol: str) -> Any:
    return getattr(load_module(f"rewritec_worker.{symbol}_{abs(hash(path)):x}", path), symbol)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class Compiler:
    def __init__(self, triton_key: str | None) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.runtime import cache, driver

        if triton_key and hasattr(cache, "triton_key"):
            # the parent's fingerprint of the installed Triton (runtime/triton_startup.py):
            # Triton's own key hashes libtriton, up to a second a process
            cache.triton_key = lambda: triton_key
        self.GPUTarget = GPUTarget
        self.driver = TargetDriver()
        driver.set_active(self.driver)

    def compile(self, path: str, symbol: str, target: list[Any], args: list[Any],
                kwargs: dict[str, Any]) -> Any:
        self.driver.target = self.GPUTarget(*target)
        jit = _load(path, symbol)
        return jit.warmup(*args, grid=(1,), **kwargs)

    def warm(self, target: list[Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="rewritec-warm-") as directory:
            path = Path(directory) / "rewritec_warm.py"
            path.write_text(WARM_SOURCE)
            self.compile(str(path), "rewritec_warm", target,
                         [Pointer("float32", 0), Pointer("float32", 0), 4096], {"BLOCK": 1024})


def answer(compiled: Any) -> dict[str, Any]:
    metadata = {k: v for k, v in compiled.metadata._asdict().items() if _jsonable(v)}
    return {"ok": True, "metadata": metadata, "arg_names": list(compiled.src.fn.arg_names),
            "signature": dict(compiled.src.signature),
            "cubin": base64.b64encode(compiled.asm["cubin"]).decode()}


class Lines:
    """The lines of a file descriptor, and whether one is waiting unread."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def waiting(self) -> bool:
        return b"\n" in self.buffer or bool(select.select([self.fd], [], [], 0)[0])

    def readline(self) -> str:
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                line, self.buffer = self.buffer, b""
                return line.decode()
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode() + "\n"


def main() -> int:
    def send(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    sys.meta_path.insert(0, NoTorch())
    lines = Lines(sys.stdin.fileno())
    hello = json.loads(lines.readline() or "{}")
    compiler = Compiler(hello.get("triton_key"))
    for name in hello.get("imports") or ():  # what Triton's first compile imports
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # The small kernel pays Triton's first compile ahead, unless a job came first
    # (a graph traced faster than this started): that job must not wait for it.
    if hello.get("warm") and not lines.waiting():
        try:
            compiler.warm(hello["warm"])
        except Exception:  # noqa: BLE001 - a failed warm-up only means a slower first job
            pass
    send({"ready": True})
    while line := lines.readline():
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            compiled = compiler.compile(job["path"], job["symbol"], job["target"],
                                        [decode(a) for a in job["args"]], job["kwargs"])
            reply = answer(compiled)
        except Exception as e:  # noqa: BLE001 - the parent compiles this one itself
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        send({"id": job["id"], **reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
