"""The pipeline of passes over one graph: one explicit, ordered list, `PASSES`.

Each pass has a name and a line saying why it is where it is; the order is the
whole contract, and no rule registers itself anywhere else. A pass reads what it
needs from the `Context` of the compilation (the rules, the target's answers, the
diagnostics asked for), so that none is special-cased by name: a rewrite pass runs
its kinds of rules to a fixed point, a target pass runs what the target supplies
(the layout, the kernel variants), and the fuse pass groups terms into kernels.
After these, runtime/prepare.py builds the kernels and compiler.py lowers the graph.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from . import diag
from .errors import RewriteStop
from .fuse import Space, fuse
from .ops import OpTable, default_op_table
from .rewrite import REWRITE_SECONDS, Explanation, Folder, Rewriter, RuleStats
from .rules import Rule
from .term import Graph, Term, TermStore
from .trace import Trace


@dataclass
class Context:
    """One graph's compilation, as its passes see it. `can_compile` and `spaces`
    (each kernel kind's iteration space: kinds/registry.py) are the kernel target
    (None: the fuse pass leaves everything to ATen); `relayout(graph) -> (graph,
    summary)` is the layout pass (None: layouts stay); `variants(graph, ctx) ->
    (graph, summary)` the kernel-variants pass (kinds/variants.py; None: kernels
    run as grouped), which records its named rewrites through `rewrote`; `explain`
    (the `explain` option, `rewritec explain`) watches one rule, rewrite or fuse."""

    store: TermStore
    rules: list[Rule]
    table: OpTable
    folder: Folder | None = None
    is_frozen: Callable[[Term], bool] | None = None
    can_compile: Callable[[Term], bool] | None = None
    spaces: Mapping[str, Callable[[Term], Space]] = field(default_factory=dict)
    relayout: Callable[[Graph], tuple[Graph, str]] | None = None
    variants: Callable[[Graph, Context], tuple[Graph, str]] | None = None
    debug: int = 0
    log: Callable[[str], None] = diag.log.info
    explain: Explanation | None = None
    seconds: float = REWRITE_SECONDS
    trace: Trace | None = None  # every firing in order (engine/trace.py), when asked for
    # what the passes did
    fired: Counter[str] = field(default_factory=Counter)
    stats: dict[str, RuleStats] = field(default_factory=dict)
    phase_log: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # wall seconds per pass

    def say(self, line: str) -> None:
        self.phase_log.append(line)
        if self.debug >= 1:
            self.log(line)

    def rewrote(self, step: str, location: str, before: Term, after: Term) -> None:
        """A named step that is not a YAML rule (a kernel rewrite such as Welford's,
        kinds/kind.py: KernelRewrite) fired: counted and traced as a rule's firing."""
        self.fired[step] += 1
        if self.trace is not None:
            self.trace.fired(step, location, before, after)

    def moved(self, now: Mapping[Term, Term]) -> None:
        """A pass rebuilt the graph: `now` maps its terms to their new ones."""
        if self.trace is not None:
            self.trace.moved(now)


class Pass(Protocol):
    """One step of the pipeline: its name, why it is where it is, and what it does."""

    @property
    def name(self) -> str: ...

    @property
    def why(self) -> str: ...

    def run(self, graph: Graph, ctx: Context) -> Graph: ...


def _ms(start: float) -> str:
    return f"{1000 * (time.perf_counter() - start):.1f} ms"


@dataclass(frozen=True)
class RewritePass:
    """Rules of `kinds` rewritten to a fixed point (engine/rewrite.py)."""

    name: str
    kinds: tuple[str, ...]
    why: str
    fold_constants: bool = False

    def run(self, graph: Graph, ctx: Context) -> Graph:
        rules = [r for r in ctx.rules if r.kind in self.kinds]
        folder = ctx.folder if self.fold_constants else None
        if not rules and folder is None:
            return graph
        start, n_before = time.perf_counter(), len(graph.terms())
        rw = Rewriter(ctx.store, ctx.table, rules, stats=ctx.stats, explain=ctx.explain,
                      folder=folder, is_frozen=ctx.is_frozen,
                      log=ctx.log if ctx.debug >= 2 else None, seconds=ctx.seconds,
                      trace=ctx.trace)
        try:
            res = rw.run(graph)
        except RewriteStop as e:
            raise RewriteStop(f"phase {self.name}: {e}") from None
        ctx.fired.update(res.fired)
        ctx.reasons.append(f"{self.name}: {res.stop_reason}")
        ctx.say(f"phase {self.name}: {sum(res.fired.values())} rewrites in {res.passes} "
                f"pass(es), {n_before} -> {len(res.graph.terms())} terms, {res.stop_reason}, "
                f"{_ms(start)}")
        return res.graph


@dataclass(frozen=True)
class TargetPass:
    """A step the target supplies (`ctx.<step>`: graph -> (graph, summary)), such as
    the layout pass (passes/layout.py) and the kernel-variants pass
    (kinds/variants.py); a compilation without it leaves the graph as it is."""

    name: str
    step: Callable[[Context], Callable[[Graph], tuple[Graph, str]] | None]
    why: str

    def run(self, graph: Graph, ctx: Context) -> Graph:
        step = self.step(ctx)
        if step is None:
            return graph
        start = time.perf_counter()
        graph, summary = step(graph)
        ctx.say(f"phase {self.name}: {summary}, {_ms(start)}")
        return graph


@dataclass(frozen=True)
class FusePass:
    """Terms grouped into `kernel` terms by the fuse rules (engine/fuse.py)."""

    name: str
    why: str

    def run(self, graph: Graph, ctx: Context) -> Graph:
        rules = [r for r in ctx.rules if r.kind == "fuse"]
        if not rules or ctx.can_compile is None:
            return graph
        start, n_before = time.perf_counter(), len(graph.terms())
        graph, groups = fuse(graph, ctx.store, ctx.table, rules, can_compile=ctx.can_compile,
                             spaces=ctx.spaces, log=ctx.log if ctx.debug >= 2 else None,
                             explain=ctx.explain, trace=ctx.trace)
        ctx.fired.update(groups)
        ctx.say(f"phase {self.name}: {sum(groups.values())} kernel(s), {n_before} -> "
                f"{len(graph.terms())} terms, {_ms(start)}")
        return graph


def _with_context(step: Callable[[Graph, Context], tuple[Graph, str]] | None, ctx: Context
                  ) -> Callable[[Graph], tuple[Graph, str]] | None:
    """A target step that records into the compile context, as TargetPass runs one."""
    if step is None:
        return None
    return lambda graph: step(graph, ctx)


PASSES: tuple[Pass, ...] = (
    RewritePass("recognize", ("recognize",),
                "replace whole idioms (attention written out as matmul, softmax, matmul) by "
                "the one op a kernel kind computes; first, before decomposition scatters them"),
    RewritePass("decompose", ("decompose",),
                "turn composite ops (gelu, softmax, layer_norm) into core ops that the "
                "simplifier and the fusers understand"),
    RewritePass("simplify", ("simplify", "fold"),
                "cancel and fold: identities, view chains, conv+bn in eval, and constant "
                "subexpressions over frozen parameters", fold_constants=True),
    TargetPass("layout", lambda ctx: ctx.relayout,
               "choose memory layouts (channels_last convolutions); after folding, so the "
               "conv weights it converts are final constants, and before fusion, so kernels "
               "see the layouts they read and write"),
    FusePass("fuse",
             "group pointwise chains, reductions and epilogues into kernels of the kinds the "
             "fuse rules name; after rewriting, so it sees the simplified graph"),
    TargetPass("variants", lambda ctx: _with_context(ctx.variants, ctx),
               "let each kernel's kind pick its variant for the target (a row too wide for "
               "registers read in chunks, a layout change in 2-d tiles) and apply the "
               "variant's named kernel rewrites (Welford's variance in a looped row); after "
               "fusion, since it needs the whole group, and before the graph is lowered"),
)


@dataclass
class PipelineResult:
    graph: Graph
    fired: Counter[str]
    stop_reason: str
    stats: dict[str, RuleStats] = field(default_factory=dict)
    phase_log: list[str] = field(default_factory=list)
    # wall seconds per pass, in order
    phase_seconds: dict[str, float] = field(default_factory=dict)


def run_pipeline(graph: Graph, store: TermStore, rules: list[Rule], *,
                 table: OpTable | None = None, folder: Folder | None = None,
                 is_frozen: Callable[[Term], bool] | None = None,
                 can_compile: Callable[[Term], bool] | None = None,
                 spaces: Mapping[str, Callable[[Term], Space]] | None = None,
                 relayout: Callable[[Graph], tuple[Graph, str]] | None = None,
                 variants: Callable[[Graph, Context], tuple[Graph, str]] | None = None,
                 debug: int = 0,
                 log: Callable[[str], None] | None = None,
                 explain: Explanation | None = None,
                 passes: tuple[Pass, ...] = PASSES,
                 seconds: float = REWRITE_SECONDS,
                 trace: Trace | None = None) -> PipelineResult:
    """Run every pass in order (see `Context` for the arguments). Raises RewriteStop
    on a cycle or an exhausted budget (steps, or `seconds` for each rewrite pass).
    `trace` (engine/trace.py), if given, records every firing in order."""
    ctx = Context(store, rules, table or default_op_table(), folder=folder,
                  is_frozen=is_frozen, can_compile=can_compile, spaces=spaces or {},
                  relayout=relayout, variants=variants, debug=debug, log=log or diag.log.info,
                  explain=explain, seconds=seconds, trace=trace)
    if explain is not None:
        explain.ops.update(t.op for t in graph.terms())
    if trace is not None:
        trace.start(graph)
    for p in passes:
        if trace is not None:
            trace.phase = p.name
        start = time.perf_counter()
        graph = p.run(graph, ctx)
        ctx.phase_seconds[p.name] = time.perf_counter() - start
    return PipelineResult(graph, ctx.fired, "; ".join(ctx.reasons) or "no rules", ctx.stats,
                          ctx.phase_log, ctx.phase_seconds)
