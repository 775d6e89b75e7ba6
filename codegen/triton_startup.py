"""Triton's one-time start-up, begun on a thread while a CUDA graph is traced.

The first Triton kernel a process launches pays for Triton's own start-up:
importing it, building (fresh cache) or loading its CUDA driver module, and
hashing its installed libraries into the key of its kernel cache (`triton_key`;
0.4 s on the H200 host, cold or warm; rewritec keeps the key, see `_stored_key`).
None of it depends on the graph. So the
backend calls `start()` as soon as it receives a graph with CUDA inputs, and
the work runs while AOTAutograd traces and the rules rewrite; most of it holds
no GIL (hashing large buffers, reading files, waiting on the C compiler).
`wait()`, called before the first Triton kernel is loaded, joins the thread, so
the two never race. A failure here is ignored: the kernel build that follows
meets the same problem and reports it (or falls back to ATen) itself.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _start_up() -> None:
    import triton  # noqa: F401
    from triton.runtime import cache, driver

    driver.active.get_current_target()
    key = getattr(cache, "triton_key", None)  # where triton 3.x keeps it
    if key is not None:
        value = _stored_key(cache.__file__, key)
        # Triton's own process pools hand their workers the key the same way.
        cache.triton_key = lambda: value


def _stored_key(cache_file: str, compute: Callable[[], Any]) -> str:
    """`triton_key()`, kept in rewritec's cache under a fingerprint of the files it
    hashes (their paths, sizes and modification times): reading the fingerprint
    takes a few milliseconds where hashing libtriton takes 0.35 s. Any change to an
    installed Triton file changes the fingerprint, and the key is hashed anew."""
    from .build import cache_dir

    root = Path(cache_file).resolve().parents[1]  # triton/runtime/cache.py -> triton/
    h = hashlib.sha256(getattr(sys.modules.get("triton"), "__version__", "").encode())
    for f in installed_files(root):
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    path = cache_dir() / f"triton_key-{h.hexdigest()[:32]}"
    try:
        return path.read_text()
    except OSError:
        pass
    value = str(compute())
    fd, tmp = tempfile.mkstemp(prefix=".triton_key.", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        out.write(value)
    os.replace(tmp, path)
    return value


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


def wait() -> None:
    """Block until a started start-up has finished; return at once otherwise."""
    thread = _thread
    if thread is not None:
        thread.join()
