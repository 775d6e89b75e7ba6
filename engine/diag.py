"""Diagnostics that point at the user: the `rewritec` logger and warning stack levels.

Torch-free on purpose (the engine imports it, and so can everything above it).

- `log` is `logging.getLogger("rewritec")`. Debug lines go through it, each one
  starting with the name of its graph (`g0_forward: phase simplify: ...`), so that a
  logging level or filter on "rewritec" silences them.
- `enable_debug(level)` is what REWRITEC_DEBUG=1|2|3 (or options={"debug": N}) does:
  it attaches one handler printing `[rewritec] message` to stdout, once per process.
- `user_stacklevel()` is the `stacklevel` for `warnings.warn` that names the first
  frame outside rewritec's library code and outside torch: the user's line.
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType

log = logging.getLogger("rewritec")

# REWRITEC_DEBUG level -> logging level: 1 says one line per phase (INFO), 2 and 3
# also every firing and the final graph (DEBUG).
LEVELS = {1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package folder also holds tests, examples, benchmarks and scripts: user code.
_LIBRARY = tuple(os.path.join(_ROOT, d) + os.sep
                 for d in ("engine", "aten", "frontend", "passes", "kinds", "runtime", "templates"))


class _Stdout(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stdout is now (pytest's capture, a redirect), as print did."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


_handler: logging.Handler | None = None
_our_level = logging.NOTSET  # the logger level enable_debug set, while nobody changed it


def enable_debug(level: int) -> None:
    """REWRITEC_DEBUG=level: attach the `[rewritec]` handler (once per process) and
    lower the logger's level to the one `level` needs; a level the user set is
    theirs to keep."""
    global _handler, _our_level
    if level < 1:
        return
    if _handler is None:
        _handler = _Stdout()
        _handler.setFormatter(logging.Formatter("[rewritec] %(message)s"))
        log.addHandler(_handler)
    want = LEVELS[min(level, 3)]
    if log.level in (logging.NOTSET, _our_level) and (log.level or 100) > want:
        log.setLevel(want)
        _our_level = want


def level_from_logger() -> int:
    """The REWRITEC_DEBUG level that the "rewritec" logger's own level asks for
    (TORCH_LOGS="rewritec" or setLevel(INFO) -> 1, "+rewritec" or DEBUG -> 3); 0 when
    it is unset or was set by enable_debug, so neither a root logger at DEBUG nor an
    earlier REWRITEC_DEBUG turns more output on."""
    if log.level in (logging.NOTSET, _our_level) or log.level > logging.INFO:
        return 0
    return 1 if log.level > logging.DEBUG else 3


def _own(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap> and the like
        return True
    path = os.path.abspath(filename)
    if os.path.dirname(path) == _ROOT or path.startswith(_LIBRARY):
        return True
    torch = sys.modules.get("torch")
    torch_file: str | None = getattr(torch, "__file__", None)
    return torch_file is not None and path.startswith(os.path.dirname(torch_file) + os.sep)


def user_stacklevel() -> int:
    """`stacklevel` for a `warnings.warn` made by the caller of this function, so the
    warning names the first frame outside rewritec and torch (2 if there is none)."""
    frame: FrameType | None = sys._getframe(1)  # the caller of warnings.warn: stacklevel 1
    level = 1
    while frame is not None:
        if not _own(frame.f_code.co_filename):
            return level
        frame = frame.f_back
        level += 1
    return 2
