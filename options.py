"""Compile options, one place for all of them.

Given as `rewritec.compile(model, **options)`, `torch.compile(model,
backend="rewritec", options={...})`, or CLI flags. Environment variables
fill in what the call leaves out: REWRITEC_RULES (extra rule paths, separated
by os.pathsep), REWRITEC_DEBUG (0-3), REWRITEC_STRICT=1, REWRITEC_TARGET,
REWRITEC_STATS=1 (print per-rule statistics when the process exits),
REWRITEC_CONV_LAYOUT (auto, channels_last or keep), REWRITEC_CUDAGRAPHS (auto,
on or off), REWRITEC_GRAPH_CACHE=0 (no graph cache), REWRITEC_COMPILE_BUDGET
(seconds of C++ compiler time per graph).
"""

from __future__ import annotations

import difflib
import atexit
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from . import report
from .engine import diag
from .engine.errors import RewritecError

TARGETS = ("auto", "aten", "triton", "openmp")
CONV_LAYOUTS = ("auto", "channels_last", "keep")
CUDAGRAPHS = ("auto", "on", "off")
# torch.compile's modes. default: today's plans; reduce-overhead: replay every graph
# that can be replayed (training too) as CUDA graphs (cudagraphs="on"); max-autotune:
# also time kernel configurations at first launch and keep the fastest on disk
# (runtime/autotune.py); max-autotune-no-cudagraphs: that, with cudagraphs as given.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
DEVICES = (None, "cpu", "cuda")
# Options whose value is True or False, nothing else: strict="no" is not off.
BOOL_OPTIONS = ("strict", "freeze", "rewrite", "fast_math", "graph_cache", "profile")
DEBUG_LEVELS = range(4)


def closest(name: str, known: Any) -> str:
    """' (did you mean X?)' for the known name nearest `name`, or ''."""
    near = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _print_stats_at_exit() -> None:
    if report.RULE_STATS:
        print("[rewritec] rule statistics\n" + report.stats_table())


if os.environ.get("REWRITEC_STATS", "") not in ("", "0"):
    atexit.register(_print_stats_at_exit)


# Options every compilation in the process starts from, under those it is given:
# `rewritec compile` puts its command line here while the script runs, so that
# rewritec.compile(...) and torch.compile(..., backend="rewritec") calls in the
# script honour --out, --rules, --strict and the rest too.
PROCESS_DEFAULTS: dict[str, Any] = {}


@dataclass(frozen=True)
class Options:
    # Where kernels run: "cpu", "cuda", or None to follow the inputs.
    device: str | None = None
    # Which kernel generator: auto (triton on cuda, openmp on cpu), aten (no
    # generated kernels), or one forced (triton on CPU needs TRITON_INTERPRET=1).
    target: str = "auto"
    # Extra rule files or folders, added to the built-in rules.
    rules: tuple[str, ...] = ()
    # Folder for captured graphs, final graphs and generated code (None: nothing written).
    out_dir: str | None = None
    # Turn every fallback (whole graph or one group) into an error.
    strict: bool = False
    # Fold parameters of inference graphs as constants (aten/fold.py). Opt-in, as
    # Inductor's freezing is: each call checks the parameters' identity, version and
    # data pointer, but a write through `p.data` changes none of them.
    freeze: bool = False
    # Run rewriting at all (False: capture + ATen execution only).
    rewrite: bool = True
    debug: int = 0
    # Also apply rules marked `fp_exact: false` (exact over the reals, not under
    # inf/nan or overflow), like a C compiler's -ffast-math.
    fast_math: bool = False
    # Names of rules to leave out.
    disable: tuple[str, ...] = field(default_factory=tuple)
    # Memory layout of 4-d convolutions (passes/layout.py): channels_last (NHWC,
    # where cuDNN and oneDNN are fastest), keep (as captured), or auto:
    # channels_last for inference graphs where the convolutions save more than the
    # layout copies around them cost (on the CPU, always), keep elsewhere.
    conv_layout: str = "auto"
    # Replay inference graphs on CUDA as one CUDA graph (runtime/cudagraphs.py): on,
    # off, or auto: graphs of at least AUTO_MIN_LAUNCHES launches (fewer without
    # matrix products), where Python's launch cost outweighs a replay's.
    cudagraphs: str = "auto"
    # Keep compiled inference graphs in $REWRITEC_CACHE_DIR/graphs and reuse them when
    # the same TorchDynamo graph comes again, skipping AOTAutograd, the rules and code
    # generation (runtime/graph_cache.py). REWRITEC_GRAPH_CACHE=0 turns it off.
    graph_cache: bool = True
    # Seconds of C++ compiler time one graph may spend (REWRITEC_COMPILE_BUDGET); once
    # spent, its kernels left fall back to ATen with a warning, so a compiler that
    # never returns stalls a compilation that long at most. None: no budget (each
    # build still stops after runtime/build.py: BUILD_TIMEOUT_S).
    compile_budget: float | None = 120.0
    # torch.compile's `mode` (MODES above), also given as options={"mode": ...}.
    mode: str = "default"
    # A rule name to watch (`rewritec explain`): each graph records the closest the
    # rule came to firing, or for a fuse rule why its groups did not form
    # (report.EXPLANATIONS). A graph-cache load would watch nothing, so it is skipped.
    explain: str | None = None
    # Time every kernel launch and ATen call of the compiled graphs' calls
    # (runtime/profile.py) into report.json's `profile` and report.html. Profiled
    # graphs skip the graph cache and CUDA-graph replay: each launch is timed.
    profile: bool = False

    @property
    def autotune(self) -> bool:
        """Whether kernels' launch configurations are timed (runtime/autotune.py)."""
        return self.mode in AUTOTUNE_MODES

    @classmethod
    def make(cls, options: dict[str, Any] | None = None, **kw: Any) -> Options:
        given = dict(PROCESS_DEFAULTS)
        given.update(options or {})
        given.update(kw)
        known = {f.name for f in fields(cls)}
        unknown = set(given) - known
        if unknown:
            hints = "; ".join(f"{n!r}{closest(str(n), known)}" for n in sorted(unknown, key=str))
            raise RewritecError(f"unknown rewritec option(s): {hints}; "
                                f"known: {', '.join(sorted(known))}")
        env_rules = tuple(p for p in os.environ.get("REWRITEC_RULES", "").split(os.pathsep) if p)
        rules = given.get("rules", ())
        if isinstance(rules, str | Path):
            rules = (rules,)
        given["rules"] = tuple(str(r) for r in rules) + env_rules
        if "debug" not in given:
            env_debug = os.environ.get("REWRITEC_DEBUG", "0") or "0"
            if not env_debug.isdigit():
                raise RewritecError(f"REWRITEC_DEBUG must be 0, 1, 2 or 3, not {env_debug!r}")
            given["debug"] = int(env_debug)
        # REWRITEC_DEBUG or options={"debug": N} print through the `rewritec` logger;
        # TORCH_LOGS="rewritec" (or the logger's own level) turns the same lines on.
        if isinstance(given["debug"], int):
            diag.enable_debug(given["debug"])
            given["debug"] = max(given["debug"], diag.level_from_logger())
        given.setdefault("strict", os.environ.get("REWRITEC_STRICT", "") not in ("", "0"))
        given.setdefault("target", os.environ.get("REWRITEC_TARGET", "auto"))
        if given["target"] not in TARGETS:
            raise RewritecError(f"target must be one of {TARGETS}, not {given['target']!r}")
        given.setdefault("conv_layout", os.environ.get("REWRITEC_CONV_LAYOUT", "auto") or "auto")
        if given["conv_layout"] not in CONV_LAYOUTS:
            raise RewritecError(f"conv_layout must be one of {CONV_LAYOUTS}, "
                                f"not {given['conv_layout']!r}")
        mode = given.setdefault("mode", "default")
        if mode is None:
            mode = given["mode"] = "default"
        if mode not in MODES:
            raise RewritecError(f"unknown mode {mode!r}{closest(str(mode), MODES)}; "
                                f"known modes: {', '.join(MODES)}")
        if mode in ("reduce-overhead", "max-autotune") and "cudagraphs" not in given:
            given["cudagraphs"] = "on"
        given.setdefault("cudagraphs", os.environ.get("REWRITEC_CUDAGRAPHS", "auto") or "auto")
        if given["cudagraphs"] not in CUDAGRAPHS:
            raise RewritecError(f"cudagraphs must be one of {CUDAGRAPHS}, "
                                f"not {given['cudagraphs']!r}")
        given.setdefault("graph_cache",
                         os.environ.get("REWRITEC_GRAPH_CACHE", "1") not in ("0", ""))
        if "compile_budget" not in given and os.environ.get("REWRITEC_COMPILE_BUDGET"):
            try:
                given["compile_budget"] = float(os.environ["REWRITEC_COMPILE_BUDGET"])
            except ValueError:
                raise RewritecError("REWRITEC_COMPILE_BUDGET must be a number of seconds, "
                                    f"not {os.environ['REWRITEC_COMPILE_BUDGET']!r}") from None
        if "disable" in given:
            given["disable"] = _names(given["disable"])
        _check_values(given)
        return cls(**given)


def _names(disable: Any) -> tuple[str, ...]:
    """`disable` as a tuple of rule names; one name alone is one rule, not its letters.
    Whether each names a rule is checked when the rules are loaded (rulesets.py)."""
    if isinstance(disable, str):
        return (disable,)
    try:
        names = tuple(disable)
    except TypeError:
        raise RewritecError(f"disable must be a list of rule names, not {disable!r}") from None
    for n in names:
        if not isinstance(n, str):
            raise RewritecError(f"disable must be a list of rule names, not {disable!r}")
    return names


def _check_values(given: dict[str, Any]) -> None:
    """Reject a value of the wrong type or out of range, so that it is never read as
    something else (strict="no" as on, debug="lots" failing inside a compilation)."""
    for name in BOOL_OPTIONS:
        if name in given and not isinstance(given[name], bool):
            raise RewritecError(f"{name} must be True or False, not {given[name]!r}")
    debug = given["debug"]
    if isinstance(debug, bool) or not isinstance(debug, int) or debug not in DEBUG_LEVELS:
        raise RewritecError(f"debug must be an int 0-3, not {debug!r}")
    if given.get("device") not in DEVICES:
        raise RewritecError(f"device must be one of {DEVICES}, not {given['device']!r}")
    out_dir = given.get("out_dir")
    if out_dir is not None and not isinstance(out_dir, str | os.PathLike):
        raise RewritecError(f"out_dir must be a folder path or None, not {out_dir!r}")
    if out_dir is not None:
        given["out_dir"] = os.fspath(out_dir)
    explain = given.get("explain")
    if explain is not None and not isinstance(explain, str):
        raise RewritecError(f"explain must be a rule name or None, not {explain!r}")
    budget = given.get("compile_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)
                               or budget < 0):
        raise RewritecError(f"compile_budget must be a number of seconds (>= 0) or None, "
                            f"not {budget!r}")
