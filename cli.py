"""The `rewritec` command line.

    rewritec compile SCRIPT [--out DIR] [--device cpu|cuda] [--rules PATH]... [--profile]
                            [--package PATH]
    rewritec explain SCRIPT --rule NAME
    rewritec report DIR
    rewritec rules list | check | test [--rules PATH]...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .engine.errors import RewritecError
from .htmlreport.page import ReportPageError, write_page


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
    c.add_argument("--profile", action="store_true",
                   help="time each kernel and ATen call of the compiled graphs' calls "
                        "(report.json, report.html, and a top-10 table)")
    c.add_argument("--quiet", action="store_true", help="no summary table")
    c.add_argument("--package", metavar="PATH", default=None,
                   help="also write SCRIPT's `model` and `example_inputs` (and its "
                        "`dynamic_shapes`, if any) as a package: rewritec.load_package(PATH)")
    common(c)

    e = sub.add_parser("explain", help="why a rule did (not) fire on SCRIPT's graphs")
    e.add_argument("script")
    e.add_argument("--rule", required=True)
    common(e)

    h = sub.add_parser("report", help="rebuild DIR/report.html from an artifact folder")
    h.add_argument("dir", help="a folder written by `rewritec compile --out DIR`")

    r = sub.add_parser("rules", help="list, check or test the rule library")
    r.add_argument("action", choices=("list", "check", "test"))
    common(r)
    return p


def _fail(msg: str) -> int:
    print(f"rewritec: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "compile":
            return cmd_compile(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "explain":
            from .explain import cmd_explain  # each subcommand imports what it runs

            return cmd_explain(args)
        from .rulesets import cmd_rules  # likewise: `rules list` imports no torch

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


def cmd_compile(args: argparse.Namespace) -> int:
    # this subcommand's imports, here: `rewritec rules list` loads no torch
    from . import report
    from .compiler import PROFILED
    from .frontend.script import compile_ahead_of_time, run_script
    from .options import Options

    options: dict[str, Any] = {"out_dir": args.out, "rules": tuple(args.rules),
                               "strict": args.strict, "fast_math": args.fast_math,
                               "profile": args.profile}
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
    aot = compile_ahead_of_time(scope, options)
    if args.package:
        written = _package(scope, args.script, args.package, options)
        if written is None:
            return _fail(f"{args.script} defines no module-level `model` (an nn.Module) and "
                         "`example_inputs` to package")
    data = report.report_data(report.RECORDS, options=options, script=args.script,
                              ahead_of_time=aot)
    try:
        report.write_report(out / "report.json", data)
        write_page(out)
    except OSError as e:
        return _fail(f"cannot write {out / 'report.json'}: {e.strerror or e}")
    except ReportPageError as e:
        return _fail(str(e))
    PROFILED.clear()  # the times are in the report just written: none to write at exit
    if not args.quiet:
        print(report.summary_table(report.RECORDS))
        times = report.profile_table(data["graphs"])
        if times:
            print(f"\n{times}")
        print(f"\nartifacts: {out}{os.sep} (report.json, report.html, captured/final graphs, "
              "generated code)")
    return 0


def _package(scope: dict[str, Any], script: str, path: str, options: dict[str, Any]
             ) -> Path | None:
    """SCRIPT's model written as a package (frontend/package.py), or None if it has none."""
    import torch  # this subcommand's imports, as in cmd_compile

    from .frontend.package import package

    model, inputs = scope.get("model"), scope.get("example_inputs")
    if not isinstance(model, torch.nn.Module) or inputs is None:
        return None
    written = package(model, inputs, path, dynamic_shapes=scope.get("dynamic_shapes"),
                      options={k: v for k, v in options.items() if k != "out_dir"})
    print(f"package: {written}")
    return written


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild DIR/report.html from the files in DIR alone."""
    out = Path(args.dir)
    if not (out / "report.json").is_file():
        return _fail(f"no report.json in {out} (write one with `rewritec compile SCRIPT "
                     f"--out {out}`)")
    try:
        path = write_page(out)
    except ReportPageError as e:
        return _fail(str(e))
    print(path)
    return 0


def _no_device_for(options: dict[str, Any]) -> str | None:
    """Why the device or target asked for cannot run here, or None. Without this,
    every graph falls back and the run reports "compiled" with no kernels."""
    import torch  # only `compile` asks: the CLI starts without torch

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


if __name__ == "__main__":
    sys.exit(main())
