"""Running a user's script with every `torch.compile` routed to rewritec.

What `rewritec compile SCRIPT` and `rewritec explain SCRIPT` capture: the script
runs as __main__, each `torch.compile` that names no backend compiles through
rewritec, and a module-level `model` with `example_inputs` is also exported
(`torch.export`) and compiled ahead of time.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from ..engine.errors import RewritecError
from ..options import PROCESS_DEFAULTS, Options
from .api import compile_model
from .export import export_and_compile


def run_script(script: str, options: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """Run SCRIPT as __main__ with torch.compile routed to rewritec.

    Returns the script's globals, or None and an exit code if it raised.
    """
    path = Path(script)
    if not path.is_file():
        print(f"rewritec: error: no such script: {script}", file=sys.stderr)
        return None, 2
    real_compile = torch.compile

    def routed(model: Any = None, *, backend: Any = "inductor", **kw: Any) -> Any:
        if backend != "inductor":
            return real_compile(model, backend=backend, **kw)
        kw.pop("mode", None)
        kw.pop("options", None)
        if kw.pop("disable", False):  # torch.compile(disable=True) compiles nothing
            return (lambda m: m) if model is None else model
        # the command line's options come from PROCESS_DEFAULTS, as for every call
        if model is None:  # used as @torch.compile(...)
            return lambda m: compile_model(m, **kw)
        return compile_model(model, **kw)

    torch.compile = routed  # type: ignore[assignment]
    # every compilation while the script runs starts from the command line's options:
    # these rerouted calls, and the script's own rewritec.compile and backend="rewritec"
    PROCESS_DEFAULTS.update(options)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        return runpy.run_path(str(path), run_name="__main__"), 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            return None, code
        return {}, 0
    except BaseException as e:  # noqa: BLE001 - show the script's own traceback
        ours = _rewritec_cause(e)
        if ours is not None:  # a strict fallback: our one-line message, not torch's stack
            print(f"rewritec: error: {ours}", file=sys.stderr)
            return None, 1
        etype, value, tb = sys.exc_info()
        # Drop our own frames so the traceback starts in the user's script.
        while tb is not None and not tb.tb_frame.f_code.co_filename.endswith(path.name):
            tb = tb.tb_next
        traceback.print_exception(etype, value, tb)
        print(f"rewritec: {script} raised {etype.__name__ if etype else 'an error'}",
              file=sys.stderr)
        return None, 1
    finally:
        torch.compile = real_compile  # type: ignore[assignment]
        PROCESS_DEFAULTS.clear()
        sys.path.remove(str(path.resolve().parent))


def _rewritec_cause(e: BaseException) -> BaseException | None:
    """The RewritecError behind `e`, if any: torch.compile wraps what a backend raises
    (BackendCompilerFailed), so follow the chain down to ours."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, RewritecError):
            return x
        todo += [x.__cause__, x.__context__, getattr(x, "inner_exception", None)]
    return None


def compile_ahead_of_time(scope: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    """If the script defines `model` and `example_inputs`, export and compile them."""
    model, inputs = scope.get("model"), scope.get("example_inputs")
    if not isinstance(model, torch.nn.Module) or inputs is None:
        return None
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    compiled = export_and_compile(model, inputs, Options.make(options))
    with torch.no_grad():
        got, want = compiled(*inputs), model(*inputs)
    try:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        match = True
    except AssertionError:
        match = False
    return {"model": type(model).__name__, "matches_eager": match}
