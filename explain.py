"""`rewritec explain SCRIPT --rule NAME`: why a rule did or did not fire.

Runs SCRIPT like `rewritec compile`, with the rewriter watching one rule. For
every term whose op is the rule's root, the matcher records how far into the
pattern it got and the first step that failed (op mismatch, attribute
mismatch, guard false, replacement changes the type); the deepest attempt is
the closest partial match.
"""

from __future__ import annotations

import argparse
from typing import Any

from .engine.rewrite import Explanation
from .engine.term import render


def cmd_explain(args: argparse.Namespace) -> int:
    from . import report
    from .engine import pipeline
    from .frontend.script import compile_ahead_of_time, run_script
    from .options import Options
    from .rulesets import find_rule

    opts = Options.make(rules=tuple(args.rules), fast_math=True)
    rule = find_rule(args.rule, opts)
    explanation = Explanation(rule.name)
    ops_seen: set[str] = set()
    real_run = pipeline.run_pipeline

    def watching(graph: Any, *a: Any, **kw: Any) -> Any:
        ops_seen.update(t.op for t in graph.terms())
        kw["explain"] = explanation
        return real_run(graph, *a, **kw)

    pipeline.run_pipeline = watching  # type: ignore[assignment]
    report.reset()
    options = {"rules": tuple(args.rules), "fast_math": True, "graph_cache": False}
    try:
        # a graph loaded from the graph cache is never rewritten, so never watched
        scope, code = run_script(args.script, options)
        if scope is not None:  # the exported graph `rewritec compile` reports, watched too
            compile_ahead_of_time(scope, options)
    finally:
        pipeline.run_pipeline = real_run  # type: ignore[assignment]
    if scope is None:
        return code
    fired = sum(r.rules_fired.get(rule.name, 0) for r in report.RECORDS)
    print(f"rule {rule.name} @ {rule.location}")
    print(f"  doc:     {rule.doc}")
    print(f"  pattern: {rule.pattern_src}")
    for _, src in rule.guards:
        print(f"  where:   {src}")
    if rule.kind == "fuse":
        return _explain_fuse(rule, fired)
    print(f"  fired {fired} time(s) in {len(report.RECORDS)} graph(s); "
          f"tried on {explanation.roots_seen} `{rule.root}` term(s)")
    if not rule.fp_exact:
        print("  note: fp_exact is false, so it only runs with --fast-math")
    if explanation.roots_seen == 0:
        print(f"  no graph has a `{rule.root}` term; ops present: {', '.join(sorted(ops_seen))}")
    elif explanation.best is not None:
        best = explanation.best
        where = f" at `{render(best.term, 3)}`" if best.term is not None else ""
        print(f"  closest partial match{where}:")
        print(f"    failed: {best.reason}")
    return 0


def _explain_fuse(rule: Any, fired: int) -> int:
    """A fuse rule groups ops instead of matching one root term: say which kernels it
    made, from the compile report, rather than counting root terms it never has."""
    from . import report

    made = [(r.name, k) for r in report.RECORDS for k in r.kernels
            if rule.name in k.get("rules", ())]
    print(f"  fired {fired} time(s) in {len(report.RECORDS)} graph(s): "
          f"{len(made)} kernel(s) it grouped")
    for graph, k in made:
        print(f"    {graph}: {k.get('name', '?')} ({k.get('template', '?')}, "
              f"{k.get('replaced_ops', '?')} op(s))")
    left = sorted({op for r in report.RECORDS for op in r.fallback_ops})
    if left:
        print(f"  ops left to ATen in these graphs: {', '.join(left)}")
    return 0
