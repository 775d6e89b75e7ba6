"""Compiling one captured ATen graph: convert -> rewrite -> lower.

    FX graph --aten.convert--> terms --engine.pipeline (PASSES)--> terms
             --runtime.wrapper--> one straight-line Python function

Whatever goes wrong for a graph, the result stays correct: the graph falls
back to running the captured FX graph eagerly, with a warning naming why
(`strict` turns that into an error).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import operator
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.fx

from . import report
from .aten.bridge import Bridge
from .aten.convert import fx_to_terms
from .engine.diag import log as _log
from .engine.diag import user_stacklevel
from .engine.errors import CompileError, RewritecError
from .engine.rewrite import Explanation
from .engine.term import Graph, TermStore
from .engine.trace import Trace
from .aten.regions import CALL_LABEL as REGION_CALL
from .aten.regions import (Region, compile_regions, has_regions, region_bodies,
                           region_calls)
from .htmlreport.collect import graph_details
from .htmlreport.page import ReportPageError, write_page
from .kinds.kernels import compilable
from .kinds.registry import SPACES
from .kinds.variants import variants_for
from .options import Options
from .rulesets import for_launches, op_table_for, ruleset_for
from .aten.fold import FrozenGuard, is_frozen, make_folder
from .aten.input_writes import split_input_writes, write_back
from .engine.ops import default_op_table
from .engine.pipeline import run_pipeline
from .passes.layout import relayout_for
from .runtime.build import cxx
from .runtime.cudagraphs import (CudaGraphRunner, auto_declines, eligible, fixed_layouts,
                                 mutated_inputs)
from .runtime.graph_cache import Artifact
from .runtime.prepare import Prepared, prepare_kernels
from .runtime.profile import GraphProfile, timer_for
from .runtime.graph_plans import planned
from .runtime.wrapper import callable_label, lower


def _register_torch_log() -> None:
    """TORCH_LOGS="rewritec" (REWRITEC_DEBUG=1) and "+rewritec" (3) already work through
    torch's qualified logger names; registering the name also lists it in
    TORCH_LOGS="help". torch._logging is not a stable API, so failing here is fine."""
    try:
        from torch._logging._internal import register_log

        register_log("rewritec", "rewritec")
    except Exception:  # noqa: BLE001
        pass


_register_torch_log()

class RewritecWarning(UserWarning):
    """rewritec fell back to ATen/eager for part or all of a graph."""


def _fake_mode(example_inputs: list[Any]) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)


def dump_graph(graph: Graph) -> str:
    """A readable listing of a term graph, one term per line."""
    names = {}
    lines = []
    for i, t in enumerate(graph.terms()):
        if t.op == "const":
            names[t] = repr(t.value)
            continue
        names[t] = f"%{i}"
        if t.op == "input":
            lines.append(f"%{i} = input {t.attr('name')} ({t.attr('kind')}) : {t.meta.short()}")
            continue
        label = str(t.attr("target")) if t.op in ("aten", "call") else t.op
        args = ", ".join(names[a] for a in t.args)
        attrs = ", ".join(f"{k}={v!r}" for k, v in t.attrs if k not in ("target", "spec"))
        lines.append(f"%{i} = {label}({args}{', ' if args and attrs else ''}{attrs})"
                     f" : {t.meta.short()}")
    outs = ", ".join("None" if o is None else names[o] for o in graph.outputs)
    lines.append(f"return ({outs})")
    return "\n".join(lines)


def fx_ops(gm: torch.fx.GraphModule) -> Counter[str]:
    """The calls of a graph run eagerly as captured, named as `fallback_ops` names them
    (getitem, which only picks a result, is not a call)."""
    return Counter(callable_label(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is not operator.getitem)


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options, *,
               kind: str, params: list[bool] | None = None,
               param_values: list[Any] | None = None,
               keep: Callable[[Artifact], None] | None = None, pool: Any = None) -> Any:
    """Compile one ATen-level FX graph; returns a boxed callable (takes a list).

    `param_values` (real parameter tensors by input position) allows freezing
    an inference graph; see `aten/fold.py` for when that is sound. `keep`, if
    given, receives what the graph cache stores of a successful compilation.
    `pool` (runtime/cudagraphs.py: Pool) is the CUDA-graph memory pool a training
    graph shares with its other half.
    """
    name = report.graph_name(kind)
    rec = report.GraphRecord(name=name, kind=kind)
    report.RECORDS.append(rec)
    start = time.perf_counter()
    parts: dict[str, Any] = {}
    captured = gm
    split = split_input_writes(gm)  # updates of its inputs: one call after it
    if split is not None:
        gm, written, parts["results"] = split
        rec.input_writes = len(written)
        param_values = keep = None  # an input it updates is no constant to fold
    frozen = _freezable(opts, kind, params, param_values)
    try:
        fn = _compile(gm, example_inputs, opts, name, rec, params, frozen, parts)
        if frozen:
            def unfrozen(args: list[Any]) -> Any:
                sub = report.GraphRecord(name=f"{name}_unfrozen", kind=kind)
                return _compile(gm, args, opts, sub.name, sub, params, None)

            fn = FrozenGuard(frozen, fn, unfrozen)
        if split is not None:
            fn = write_back(fn, written, parts["results"], _returns_one(captured))
        guarded = fn
        fn = _maybe_cudagraphs(fn, captured, kind, params, opts, rec, pool,
                               region_calls(parts.get("regional")))
        _report_output_strides(kind, parts.get("output_strides"))
        # a compiled region lives in this process only: the graph cache cannot hold it
        if keep is not None and not parts["kernel_fallbacks"] and "regional" not in parts:
            keep(Artifact(name=name, source=parts["lowered"].source,
                          globals=parts["lowered"].globals, frozen=frozen or {},
                          steps=parts["steps"], cudagraphs=fn is not guarded, record=rec))
    except Exception as e:  # noqa: BLE001 - any failure means: run the graph eagerly
        reason = _reason(e)
        if opts.strict:
            raise CompileError(f"rewritec could not compile graph {name}: {reason}") from e
        warnings.warn(f"rewritec: graph {name} falls back to eager ATen: {reason}",
                      RewritecWarning, stacklevel=user_stacklevel())
        rec.status, rec.reason = "fallback", reason
        rec.profile = None  # the captured graph runs untimed
        runs = parts.get("regional", gm)  # its compiled regions, if it got that far
        rec.fallback_ops = fx_ops(runs)
        fn = _boxed(runs.forward)
        if split is not None:
            fn = write_back(fn, written, parts["results"], _returns_one(captured))
        _report_output_strides(kind, None)
    rec.compile_seconds = time.perf_counter() - start
    if opts.out_dir:
        if "captured" not in rec.files:  # it fell back before writing: the graph it runs
            with contextlib.suppress(OSError):  # _update_report warns of an unwritable folder
                _write_files(Path(opts.out_dir), rec,
                             {"captured": captured.print_readable(print_output=False)})
        _update_report(opts, rec)
    return fn


def _compile_region(opts: Options, sub: torch.fx.GraphModule, example_inputs: list[Any],
                    name: str) -> Region:
    """A region (aten/regions.py) compiles as a graph of its own; the graph that
    calls it decides on CUDA-graph replay."""
    first = len(report.RECORDS)
    fn = compile_fx(sub, example_inputs, dataclasses.replace(opts, cudagraphs="off"),
                    kind="region")
    return Region(name, fn, report.RECORDS[first])  # compile_fx records its graph first


def _update_report(opts: Options, rec: report.GraphRecord | None) -> None:
    """Rewrite out_dir/report.json and report.html with this graph added
    (docs/report.md), or as they are with `rec` None. A report that cannot be
    written does not stop a graph that compiled."""
    if rec is not None and rec.profile is not None:
        _profiled(opts)
    options = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    try:
        report.record_in_out_dir(str(opts.out_dir), rec, options)
        write_page(str(opts.out_dir))
    except OSError as e:
        warnings.warn(f"rewritec: cannot write {opts.out_dir}/report.json: {e.strerror or e}",
                      RewritecWarning, stacklevel=user_stacklevel())
    except ReportPageError as e:
        warnings.warn(f"rewritec: {e}", RewritecWarning, stacklevel=user_stacklevel())


# out_dir -> the options of its latest profiled graph. Its times come after the
# compilation, as the graph is called: the report is written again at exit.
PROFILED: dict[str, Options] = {}


def _profiled(opts: Options) -> None:
    if not PROFILED:
        atexit.register(_write_profiles_at_exit)
    PROFILED[str(opts.out_dir)] = opts


def _write_profiles_at_exit() -> None:
    try:
        write_profiles()
    except Exception as e:  # noqa: BLE001 - a process that ends says why in one line
        print(f"rewritec: the measured times were not written: {type(e).__name__}: {e}",
              file=sys.stderr)


def write_profiles() -> None:
    """Rewrite report.json and report.html of every out_dir holding a profiled graph
    with the times measured so far (`rewritec.write_profiles()`; also at exit)."""
    for out_dir, opts in list(PROFILED.items()):
        if not report.OUT_DIR_RECORDS.get(os.path.abspath(out_dir)):
            continue  # its records were reset: nothing of this process to write
        _update_report(opts, None)


def _maybe_cudagraphs(fn: Any, gm: torch.fx.GraphModule, kind: str, params: list[bool] | None,
                      opts: Options, rec: report.GraphRecord, pool: Any = None,
                      regions: list[Region] | None = None) -> Any:
    """Wrap a graph for CUDA-graph replay (runtime/cudagraphs.py); the runner itself
    falls back to `fn` for CPU arguments or a failed capture."""
    if opts.cudagraphs == "off" or not torch.cuda.is_available():
        return fn
    if rec.profile is not None:  # a replay would hide each launch from its timer
        rec.cudagraphs = "off: profile (each launch is timed)"
        return fn
    training = opts.cudagraphs == "on"
    why_not = eligible(gm, kind, aliased_outputs=False, training=training)
    for sub in region_bodies(gm):  # a replay runs the regions' kernels too
        why_not = why_not or eligible(sub, kind, aliased_outputs=False, training=training)
    if why_not is None and opts.cudagraphs == "auto":
        why_not = auto_declines(*launched(rec, regions or []))
    if why_not is not None:
        rec.cudagraphs = f"off: {why_not}"
        return fn

    def log(line: str) -> None:
        rec.cudagraphs = line
        if opts.debug >= 1:
            _log.info("%s: %s", rec.name, line)

    return CudaGraphRunner(fn, params or [], opts.cudagraphs, log, kind=kind,
                           user_outputs=_user_outputs(kind), pool=pool,
                           mutated=sorted(set(mutated_inputs(gm).values())),
                           applied=_applied_outputs(kind), fixed=fixed_layouts(gm))


def launched(rec: report.GraphRecord, regions: list[Region]
             ) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """The ATen calls and kernels one run of a graph launches: its own, and those of
    each region call (`regions` holds a region once per call)."""
    ops, kernels = Counter(rec.fallback_ops), list(rec.kernels)
    for region in regions:
        ops.update(region.record.fallback_ops)
        kernels += region.record.kernels
    return dict(ops), kernels


def _aot_context() -> Any:
    """AOTAutograd's tracing context while it compiles a graph (its forward metadata,
    the output strides it collects), or None."""
    from torch._guards import TracingContext

    return TracingContext.try_get()


def _saved_positions(kind: str, gm: torch.fx.GraphModule, count: int | None = None
                     ) -> frozenset[int]:
    """The positions of a training forward graph's results that only its backward
    reads (AOTAutograd's saved tensors). Empty for other graphs, for a graph
    compiled in regions, or when AOTAutograd does not say. `count`: how many of the
    graph's results AOTAutograd sees (the rest are input updates)."""
    if kind != "forward" or has_regions(gm):
        return frozenset()
    ctx = _aot_context()
    meta = getattr(ctx, "fw_metadata", None)
    if count is None:
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        results = output.args[0]
        count = len(results) if isinstance(results, tuple | list) else 1
    try:
        saved = meta.tensors_saved_for_backwards_slice  # type: ignore[union-attr]
        return frozenset(range(*saved.indices(count)))
    except Exception:  # noqa: BLE001 - another torch, or no metadata: none known
        return frozenset()


def _saved_outputs(kind: str, gm: torch.fx.GraphModule, count: int | None = None
                   ) -> frozenset[int]:
    """The saved tensors (`_saved_positions`) the layout phase may leave in the
    layout they were made in (passes/layout.py): only where AOTAutograd is told
    their strides."""
    if getattr(_aot_context(), "output_strides", None) is None:
        return frozenset()  # no one to tell the strides to: eager's layouts it is
    return _saved_positions(kind, gm, count)


def _report_output_strides(kind: str, strides: list[tuple[int, ...] | None] | None) -> None:
    """Tell AOTAutograd the strides of a forward graph's results, so the backward
    graph is traced over saved activations as this graph lays them out (what
    Inductor reports after its layout optimization). `strides` None: the graph
    returns eager's layouts, and AOTAutograd is told nothing."""
    if kind != "forward" or strides is None:
        return
    reported = getattr(_aot_context(), "output_strides", None)
    if reported is not None and not reported:
        reported.extend(strides)


def _applied_outputs(kind: str) -> list[int]:
    """A forward graph's results that are new values of inputs it updates (BatchNorm's
    running statistics), which AOTAutograd's runtime copies into those inputs right
    after the call (data only: no metadata, no `set_`; inputs that need no gradient);
    empty for other graphs, or when AOTAutograd does not say."""
    if kind != "forward":
        return []
    meta = getattr(_aot_context(), "fw_metadata", None)
    try:
        infos = [meta.input_info[i]  # type: ignore[union-attr]
                 for i in meta.mutated_inp_runtime_indices]  # type: ignore[union-attr]
        return [pos for pos, info in enumerate(infos)
                if info.mutates_data and not info.mutates_metadata
                and not info.mutates_storage_metadata and not info.requires_grad
                and not getattr(info, "mutation_inductor_storage_resize", False)]
    except Exception:  # noqa: BLE001 - another torch: every result is copied out
        return []


def _user_outputs(kind: str) -> int | None:
    """How many of a forward graph's results reach the caller (mutated inputs, the
    outputs, their bases: AOTAutograd's `num_forward_returns`), the rest being saved
    for the backward; None for other graphs, or when AOTAutograd does not say (the
    runner then copies every result of the forward graph out)."""
    if kind != "forward":
        return None
    meta = getattr(_aot_context(), "fw_metadata", None)
    returns = getattr(meta, "num_forward_returns", None)
    return returns if isinstance(returns, int) else 1 << 30


def _reason(e: Exception) -> str:
    if isinstance(e, RewritecError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _freezable(opts: Options, kind: str, params: list[bool] | None,
               values: list[Any] | None) -> dict[int, torch.Tensor] | None:
    if not opts.freeze or kind not in ("inference", "export") or not params or not values:
        return None
    frozen = {i: v for i, (p, v) in enumerate(zip(params, values, strict=False))
              if p and isinstance(v, torch.Tensor) and not isinstance(
                  v, torch._subclasses.FakeTensor)}
    return frozen or None


def _is_view(t: Any) -> bool:
    """Does `t` return a view of its first operand (view, permute, slice, ...)?"""
    if t.op == "getitem":
        # an output of a multi-output op, such as split; a kernel's outputs (engine/
        # fuse.py: side outputs) are tensors of their own
        return t.args[0].op != "kernel"
    if t.op == "aten":
        returns = t.attr("target")._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    return default_op_table().category(t.op) == "view" and t.op in default_op_table().ops


def _base(t: Any) -> Any:
    """The term whose memory `t` uses: views followed back to their base."""
    while t is not None and t.args and _is_view(t):
        t = t.args[0]
    return t


def _input_alias(t: Any) -> bool:
    """Is `t` a graph input, or a view of one?"""
    base = _base(t)
    return base is not None and base.op == "input"


def _outputs_to_clone(graph: Graph, bases: tuple[Any, ...], aliased_before: list[bool],
                      saved: frozenset[int] = frozenset()) -> set[int]:
    """Output positions whose tensor eager returned fresh but the wrapper would
    share: an output a rewrite turned into (a view of) an input (x * 1 -> x), a
    folded constant (or a view of one), and
    an output using the same memory as an earlier one where eager's did not
    (hash-consing merged two equal computations; eager gave two tensors, which
    autograd and in-place updates tell apart). `bases` holds, per output, the
    FX node whose memory eager's output uses.

    Saved tensors (`saved`: positions only the backward graph reads) may share
    memory with each other and with folded constants: nobody updates them in place
    or tells them apart, and a copy costs a launch and its memory until the
    backward. Under autocast, eager casts a normalized activation once per linear
    layer reading it (q, k and v: three saved bf16 copies of one value), and a
    causal mask folded to a constant is saved once per attention layer."""
    clones: set[int] = set()
    first: dict[Any, int] = {}
    for i, o in enumerate(graph.outputs):
        if o is None:
            continue
        was = aliased_before[i] if i < len(aliased_before) else True
        if _input_alias(o) and not was:
            clones.add(i)
            continue
        if _base(o).op == "tensor":
            # A folded constant lives across calls: hand out a copy, or the caller
            # could change it for every later call (the backward only reads it).
            if i not in saved:
                clones.add(i)
            continue
        j = first.setdefault(_base(o), i)
        if j != i and (i >= len(bases) or bases[i] is not bases[j]) \
                and not (i in saved and j in saved):
            clones.add(i)
    return clones


def choose_target(opts: Options, graph: Graph) -> str:
    """Which kernel generator serves this graph: `aten` means none."""
    if opts.target != "auto":
        return opts.target
    device = opts.device
    if device is None:
        device = "cuda" if "cuda" in graph_devices(graph) else "cpu"
    if device == "cuda":
        return "triton"
    return "openmp" if cxx() else "aten"


def graph_devices(graph: Graph) -> set[str]:
    """The device types of the graph's tensors (`cpu`, `cuda`)."""
    return {t.meta.device.split(":")[0] for t in graph.terms() if t.meta.kind == "tensor"}


def _returns_one(gm: torch.fx.GraphModule) -> bool:
    """Does `gm` return a bare value rather than a tuple of them?"""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return not isinstance(output.args[0], tuple | list)


def _boxed(fn: Any) -> Any:
    def call(args: list[Any]) -> Any:
        return fn(*args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _compile(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options, name: str,
             rec: report.GraphRecord, params: list[bool] | None,
             frozen: dict[int, torch.Tensor] | None, parts: dict[str, Any] | None = None) -> Any:
    """The compilation itself; `parts` (if given) receives the lowered wrapper, the
    fold steps and the count of kernels that went back to ATen, for the graph cache."""
    parts = {} if parts is None else parts
    parts["steps"] = {}
    parts["kernel_fallbacks"] = 0
    captured = gm
    if has_regions(gm):
        # each distinct region compiled once (aten/regions.py); gm calls them
        gm = parts["regional"] = compile_regions(gm, partial(_compile_region, opts))
    # the package's ops and those the user's rule files declare: conversion, rules,
    # kernels and the ATen calls of the wrapper all read this one table
    table = op_table_for(opts) if opts.rewrite else None
    bridge = Bridge(_fake_mode(example_inputs), table)
    clock = time.perf_counter()
    conv = fx_to_terms(gm, bridge, params, frozen)
    graph = conv.graph
    rec.nodes_in = len(graph.terms())
    rec.phase_seconds["convert"] = time.perf_counter() - clock
    aliased_before = [_input_alias(o) for o in graph.outputs]
    # every firing in order, for the HTML report; only kept when it is written
    trace = Trace() if opts.out_dir else None
    if opts.rewrite:

        target = choose_target(opts, graph)
        explanation = None
        if opts.explain:
            explanation = Explanation(opts.explain)
            report.EXPLANATIONS.append((name, explanation))
        rules = for_launches(ruleset_for(opts), target, opts)
        result = run_pipeline(graph, conv.store, rules, table=bridge.table,
                              debug=opts.debug, explain=explanation,
                              log=lambda line: _log.info("%s: %s", name, line),
                              folder=make_folder(conv.store, bridge, parts["steps"]),
                              is_frozen=is_frozen,
                              can_compile=compilable(target, bridge.table), spaces=SPACES,
                              variants=variants_for(target, conv.store),
                              relayout=relayout_for(opts.conv_layout, rec.kind, conv.store,
                                                    bridge, rec.layout, parts["steps"],
                                                    _saved_outputs(rec.kind, captured,
                                                                   parts.get("results")),
                                                    replayed=opts.cudagraphs == "on"),
                              trace=trace)
        graph = result.graph
        rec.rules_fired.update(result.fired)
        rec.stop_reason = result.stop_reason
        rec.phase_seconds.update(result.phase_seconds)
        report.add_rule_stats(result.stats)
        if opts.debug >= 3:
            for line in ["final graph", *dump_graph(graph).splitlines()]:
                _log.debug("%s: %s", name, line)
    rec.nodes_out = len(graph.terms())
    if rec.layout.get("saved_in_new_layout"):
        parts["output_strides"] = [
            tuple(o.meta.strides) if o is not None and o.meta.kind == "tensor"
            and all(isinstance(x, int) for x in o.meta.strides) else None
            for o in graph.outputs[:parts.get("results")]]
    # (under CUDA-graph replay too: a shared folded constant is none of the graph's
    # memory there, runtime/cudagraphs.py: `_capture`)
    shared = _saved_positions(rec.kind, captured, parts.get("results"))
    clones = _outputs_to_clone(graph, conv.output_nodes, aliased_before, shared)
    prepared = _prepare(graph, conv.store, opts, name, rec, bridge, parts)
    launchers: dict[Any, Any] = {}
    if prepared is not None:
        graph, launchers = prepared.graph, prepared.launchers
    clock = time.perf_counter()
    rec.profile = GraphProfile(timer_for(graph_devices(graph))) if opts.profile else None
    lowered = lower(graph, bridge, name, rules=sorted(rec.rules_fired), clone_outputs=clones,
                    launchers=launchers, profile=rec.profile)
    rec.phase_seconds["lower"] = time.perf_counter() - clock
    rec.fallback_ops.update(lowered.fallback_ops)
    rec.fallback_ops.pop(REGION_CALL, None)
    parts["lowered"] = lowered
    if opts.out_dir:
        _write_artifacts(Path(opts.out_dir), rec, captured, lowered.source, conv.graph, graph,
                         trace or Trace(), prepared, choose_target(opts, graph))
    fn = lowered.fn
    fn._boxed_call = True
    return planned(fn, lowered.source)


def _prepare(graph: Graph, store: TermStore, opts: Options, name: str,
             rec: report.GraphRecord, bridge: Bridge, parts: dict[str, Any]) -> Prepared | None:
    """The graph's kernel terms built into launchers (codegen/prepare.py: Prepared),
    or None for a graph without kernels."""
    if not any(t.op == "kernel" for t in graph.terms()):
        return None
    clock = time.perf_counter()
    prepared = prepare_kernels(graph, store, choose_target(opts, graph),
                               strict=opts.strict, out_dir=opts.out_dir, name=name,
                               bridge=bridge, contract=opts.fast_math,
                               budget_s=opts.compile_budget, autotune=opts.autotune)
    parts["kernel_fallbacks"] = prepared.failed
    rec.kernels.extend(prepared.records)
    rec.kernel_cache_hits = prepared.cache_hits
    rec.phase_seconds["kernels"] = time.perf_counter() - clock
    return prepared


def _write_artifacts(out: Path, rec: report.GraphRecord, gm: torch.fx.GraphModule,
                     wrapper: str, captured: Graph, final: Graph, trace: Trace,
                     prepared: Prepared | None, target: str) -> None:
    """The graph's files in out_dir: captured and final graphs as text, the wrapper,
    and what the HTML report shows of it (htmlreport/collect.py)."""
    details = graph_details(captured, final, trace, prepared, compilable(target), target)
    _write_files(out, rec, {"captured": gm.print_readable(print_output=False),
                            "final": dump_graph(final), "wrapper": wrapper,
                            "details": json.dumps(details, default=str)})


# The file each artifact goes to, after the graph's name.
ARTIFACT_FILES = {"captured": "captured.txt", "final": "final.txt", "wrapper": "wrapper.py",
                  "details": "details.json"}


def _write_files(out: Path, rec: report.GraphRecord, texts: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for key, text in texts.items():
        path = out / f"{rec.name}.{ARTIFACT_FILES[key]}"
        path.write_text(text)
        rec.files[key] = str(path)
