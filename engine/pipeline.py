"""The pipeline of rewriting phases: one explicit, ordered list.

Each phase runs its kinds of rules to a fixed point before the next starts.
The order is the whole contract; no rule registers itself anywhere else.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import diag
from .errors import RewriteStop
from .fuse import Space, fuse
from .ops import OpTable, default_op_table
from .rewrite import REWRITE_SECONDS, Explanation, Folder, Rewriter, RuleStats
from .rules import Rule
from .term import Graph, Term, TermStore


@dataclass(frozen=True)
class Phase:
    name: str
    kinds: tuple[str, ...]
    why: str
    fold_constants: bool = False


PHASES: tuple[Phase, ...] = (
    Phase("recognize", ("recognize",),
          "replace whole idioms (attention written out as matmul, softmax, matmul) by the "
          "one op a kernel template computes; first, before decomposition scatters them"),
    Phase("decompose", ("decompose",),
          "turn composite ops (gelu, softmax, layer_norm) into core ops that the "
          "simplifier and the fusers understand"),
    Phase("simplify", ("simplify", "fold"),
          "cancel and fold: identities, view chains, conv+bn in eval, and constant "
          "subexpressions over frozen parameters", fold_constants=True),
    Phase("layout", (),
          "choose memory layouts (channels_last convolutions); after folding, so the conv "
          "weights it converts are final constants, and before fusion, so kernels see the "
          "layouts they read and write. The target supplies it (passes/layout.py)"),
    Phase("fuse", ("fuse",),
          "group pointwise chains, reductions and epilogues into kernels; runs last so it "
          "sees the simplified graph"),
)


@dataclass
class PipelineResult:
    graph: Graph
    fired: Counter[str]
    stop_reason: str
    stats: dict[str, RuleStats] = field(default_factory=dict)
    phase_log: list[str] = field(default_factory=list)


def run_pipeline(graph: Graph, store: TermStore, rules: list[Rule], *,
                 table: OpTable | None = None, folder: Folder | None = None,
                 is_frozen: Callable[[Term], bool] | None = None,
                 can_compile: Callable[[Term], bool] | None = None,
                 spaces: Mapping[str, Callable[[Term], Space]] | None = None,
                 relayout: Callable[[Graph], tuple[Graph, str]] | None = None, debug: int = 0,
                 log: Callable[[str], None] | None = None,
                 explain: Explanation | None = None,
                 phases: tuple[Phase, ...] = PHASES,
                 seconds: float = REWRITE_SECONDS) -> PipelineResult:
    """Run every phase in order. Raises RewriteStop on a cycle or an exhausted budget
    (steps, or `seconds` for each phase).

    `relayout(graph) -> (graph, summary)` is the layout phase (None: layouts stay).
    `can_compile` and `spaces` (each kernel kind's iteration space: kinds/registry.py)
    are the kernel target the fuse phase groups for (None: everything stays on ATen)."""
    table = table or default_op_table()
    log = log or diag.log.info
    fired: Counter[str] = Counter()
    stats: dict[str, RuleStats] = {}
    phase_log: list[str] = []
    reasons = []
    for phase in phases:
        if phase.name == "layout":
            if relayout is not None:
                start = time.perf_counter()
                graph, summary = relayout(graph)
                line = (f"phase layout: {summary}, "
                        f"{1000 * (time.perf_counter() - start):.1f} ms")
                phase_log.append(line)
                if debug >= 1:
                    log(line)
            continue
        phase_rules = [r for r in rules if r.kind in phase.kinds]
        if not phase_rules and not (phase.fold_constants and folder):
            continue
        start = time.perf_counter()
        n_before = len(graph.terms())
        if phase.name == "fuse":
            # Fusion groups terms instead of rewriting them one at a time (engine/fuse.py);
            # without a kernel target (can_compile) everything stays on ATen.
            if can_compile is None:
                continue
            graph, groups = fuse(graph, store, table, phase_rules, can_compile=can_compile,
                                 spaces=spaces or {}, log=log if debug >= 2 else None)
            fired.update(groups)
            line = (f"phase fuse: {sum(groups.values())} kernel(s), {n_before} -> "
                    f"{len(graph.terms())} terms, {1000 * (time.perf_counter() - start):.1f} ms")
            phase_log.append(line)
            if debug >= 1:
                log(line)
            continue
        rw = Rewriter(store, table, phase_rules, stats=stats, explain=explain,
                      folder=folder if phase.fold_constants else None, is_frozen=is_frozen,
                      log=log if debug >= 2 else None, seconds=seconds)
        try:
            res = rw.run(graph)
        except RewriteStop as e:
            raise RewriteStop(f"phase {phase.name}: {e}") from None
        graph = res.graph
        fired.update(res.fired)
        line = (f"phase {phase.name}: {sum(res.fired.values())} rewrites in {res.passes} "
                f"pass(es), {n_before} -> {len(graph.terms())} terms, {res.stop_reason}, "
                f"{1000 * (time.perf_counter() - start):.1f} ms")
        phase_log.append(line)
        reasons.append(f"{phase.name}: {res.stop_reason}")
        if debug >= 1:
            log(line)
    return PipelineResult(graph, fired, "; ".join(reasons) or "no rules", stats, phase_log)
