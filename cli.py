"""The `rewritec` command line.

    rewritec compile SCRIPT [--out DIR] [--device cpu|cuda] [--rules PATH]...
    rewritec explain SCRIPT --rule NAME
    rewritec rules list | check | test [--rules PATH]...
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any

from . import __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rewritec", description=(
        "A pattern-rewriting compiler for PyTorch graphs driven by YAML rules."))
    p.add_argument("--version", action="version", version=f"rewritec {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--rules", action="append", default=[], metavar="PATH",
                        help="extra rule file or folder (repeatable)")

    c = sub.add_parser("compile", help="run SCRIPT with torch.compile routed to rewritec")
    c.add_argument("script")
    c.add_argument("--out", default="rewritec_out", help="artifact folder (default rewritec_out/)")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None)
    c.add_argument("--target", choices=("auto", "aten", "triton", "openmp"), default=None)
    c.add_argument("--strict", action="store_true", help="turn every fallback into an error")
    c.add_argument("--fast-math", action="store_true",
                   help="also apply rules that are exact over the reals but not under inf/nan")
    c.add_argument("--quiet", action="store_true", help="no summary table")
    common(c)

    e = sub.add_parser("explain", help="why a rule did (not) fire on SCRIPT's graphs")
    e.add_argument("script")
    e.add_argument("--rule", required=True)
    common(e)

    r = sub.add_parser("rules", help="list, check or test the rule library")
    r.add_argument("action", choices=("list", "check", "test"))
    common(r)
    return p


def _fail(msg: str) -> int:
    print(f"rewritec: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .engine.errors import RewritecError

    try:
        if args.command == "compile":
            return cmd_compile(args)
        if args.command == "explain":
            from .explain import cmd_explain

            return cmd_explain(args)
        from .rulesets import cmd_rules

        return cmd_rules(args)
    except RewritecError as e:
        return _fail(str(e))
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """The reader of stdout left early (`rewritec rules list | head`): stop quietly,
    as a Unix tool killed by SIGPIPE does, instead of a traceback. stdout goes to
    /dev/null so that the flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # 128 + SIGPIPE, the status a shell reports for `yes | head`


def run_script(script: str, options: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
    """Run SCRIPT as __main__ with torch.compile routed to rewritec.

    Returns the script's globals, or None and an exit code if it raised.
    """
    import torch

    from .frontend.api import compile_model

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

    from .options import PROCESS_DEFAULTS

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
    from .engine.errors import RewritecError

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


def cmd_compile(args: argparse.Namespace) -> int:
    from . import report
    from .options import Options

    options: dict[str, Any] = {"out_dir": args.out, "rules": tuple(args.rules),
                               "strict": args.strict, "fast_math": args.fast_math}
    if args.device:
        options["device"] = args.device
    if args.target:
        options["target"] = args.target
    from .rulesets import ruleset_for

    # Validate the options, and load and check the user's rules with the gate every
    # compilation uses, before running anything: rules the user asked for that cannot
    # be used are an error (exit 2), not a script run silently in eager.
    ruleset_for(Options.make(options))
    problem = _no_device_for(options)
    if problem:
        return _fail(problem)
    out = Path(args.out)
    problem = _unwritable(out)  # found before the script runs, not after
    if problem:
        return _fail(f"cannot write the output folder {out}: {problem}")
    report.reset()
    scope, code = run_script(args.script, options)
    if scope is None:
        return code
    aot = _compile_ahead_of_time(scope, options)
    data = report.report_data(report.RECORDS, options=options, script=args.script,
                              ahead_of_time=aot)
    try:
        report.write_report(out / "report.json", data)
    except OSError as e:
        return _fail(f"cannot write {out / 'report.json'}: {e.strerror or e}")
    if not args.quiet:
        print(report.summary_table(report.RECORDS))
        print(f"\nartifacts: {out}{os.sep} (report.json, captured/final graphs, generated code)")
    return 0


def _no_device_for(options: dict[str, Any]) -> str | None:
    """Why the device or target asked for cannot run here, or None. Without this,
    every graph falls back and the run reports "compiled" with no kernels."""
    import torch

    if torch.cuda.is_available():
        return None
    if options.get("device") == "cuda":
        return "--device cuda, but torch sees no CUDA GPU on this machine"
    if options.get("target") == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        return ("--target triton needs a CUDA GPU, or TRITON_INTERPRET=1 to run Triton's "
                "interpreter on the CPU")
    return None


def _unwritable(out: Path) -> str | None:
    """Why the artifact folder `out` cannot be made or written, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    if not out.is_dir():
        return "it is not a folder"
    if not os.access(out, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def _compile_ahead_of_time(scope: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    """If the script defines `model` and `example_inputs`, export and compile them."""
    import torch

    from .frontend.export import export_and_compile
    from .options import Options

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


if __name__ == "__main__":
    sys.exit(main())
