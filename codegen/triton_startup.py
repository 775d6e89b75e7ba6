"""Triton's one-time start-up, begun on a thread while a CUDA graph is traced.

The first Triton kernel a process launches pays for Triton's own start-up:
importing it, building (fresh cache) or loading its CUDA driver module, and
hashing its installed libraries into the key of its kernel cache (`triton_key`;
0.4 s on the H200 host, cold or warm). None of it depends on the graph. So the
backend calls `start()` as soon as it receives a graph with CUDA inputs, and
the work runs while AOTAutograd traces and the rules rewrite; most of it holds
no GIL (hashing large buffers, reading files, waiting on the C compiler).
`wait()`, called before the first Triton kernel is loaded, joins the thread, so
the two never race. A failure here is ignored: the kernel build that follows
meets the same problem and reports it (or falls back to ATen) itself.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _start_up() -> None:
    import triton  # noqa: F401
    from triton.runtime import cache, driver

    driver.active.get_current_target()
    key = getattr(cache, "triton_key", None)  # where triton 3.x keeps it
    if key is not None:
        key()


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
