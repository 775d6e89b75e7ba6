"""`rewritec explain SCRIPT --rule NAME`: why a rule did or did not fire.

Runs SCRIPT like `rewritec compile` with the `explain` option naming the rule, so
that every graph's compilation watches it (engine/rewrite.py: Explanation). For a
rewrite rule, on every term whose op is the rule's root, the matcher records how
far into the pattern it got and the first step that failed (op mismatch,
attribute mismatch, guard false, replacement changes the type); the deepest
attempt is the closest partial match. For a fuse rule, fusion records each group
that did not form and each producer a group refused, and why (engine/fuse.py).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from . import report
from .engine.rewrite import Explanation
from .engine.rules import Rule
from .engine.term import Term, render
from .frontend.script import compile_ahead_of_time, run_script
from .options import Options
from .rulesets import find_rule

SHOWN = 8  # distinct reasons listed for a fuse rule


def cmd_explain(args: argparse.Namespace) -> int:
    opts = Options.make(rules=tuple(args.rules), fast_math=True)
    rule = find_rule(args.rule, opts)
    report.reset()
    # a graph loaded from the graph cache is never rewritten, so never watched
    options = {"rules": tuple(args.rules), "fast_math": True, "graph_cache": False,
               "explain": rule.name}
    scope, code = run_script(args.script, options)
    if scope is None:
        return code
    compile_ahead_of_time(scope, options)  # the exported graph `rewritec compile` reports
    watched = _merged(rule.name, [e for _, e in report.EXPLANATIONS])
    fired = sum(r.rules_fired.get(rule.name, 0) for r in report.RECORDS)
    print(f"rule {rule.name} @ {rule.location}")
    print(f"  doc:     {rule.doc}")
    print(f"  pattern: {rule.pattern_src}")
    for _, src in rule.guards:
        print(f"  where:   {src}")
    if rule.kind == "fuse":
        return _explain_fuse(rule, fired, watched)
    print(f"  fired {fired} time(s) in {len(report.RECORDS)} graph(s); "
          f"tried on {watched.roots_seen} `{rule.root}` term(s)")
    if not rule.fp_exact:
        print("  note: fp_exact is false, so it only runs with --fast-math")
    if rule.more_launches:
        print("  note: more_launches is true, so it only runs where graphs replay as "
              "CUDA graphs (mode reduce-overhead on a GPU)")
    if watched.roots_seen == 0:
        print(f"  no graph has a `{rule.root}` term; ops present: "
              f"{', '.join(sorted(watched.ops))}")
    elif watched.best is not None:
        best = watched.best
        where = f" at `{render(best.term, 3)}`" if best.term is not None else ""
        print(f"  closest partial match{where}:")
        print(f"    failed: {best.reason}")
    return 0


def _merged(name: str, explanations: list[Explanation]) -> Explanation:
    """One explanation over every graph watched: the deepest partial match of all."""
    out = Explanation(name)
    for e in explanations:
        out.roots_seen += e.roots_seen
        out.ops |= e.ops
        out.refused += e.refused
        if e.best is not None:
            out.consider(e.best)
    return out


def _explain_fuse(rule: Rule, fired: int, watched: Explanation) -> int:
    """A fuse rule groups ops instead of rewriting one root term: say which kernels it
    made, from the compile report, then why the others did not form: a root refused
    (not in the kind's space, a guard false, taken by another rule) or a producer
    left out of a group (not in the space, a second user outside the group where
    the space takes no side outputs, an op the target cannot compile)."""
    made = [(r.name, k) for r in report.RECORDS for k in r.kernels
            if rule.name in k.get("rules", ())]
    print(f"  fired {fired} time(s) in {len(report.RECORDS)} graph(s): "
          f"{len(made)} kernel(s) it grouped; its pattern matched {watched.roots_seen} root(s)")
    for graph, k in made:
        print(f"    {graph}: {k.get('name', '?')} ({k.get('template', '?')}, "
              f"{k.get('replaced_ops', '?')} op(s))")
    roots = [(root, why) for root, t, why in watched.refused if t is root]
    producers = [(root, t, why) for root, t, why in watched.refused if t is not root]
    if roots:
        print("  groups that did not form:")
        _reasons([(root, why) for root, why in roots])
    if producers:
        print("  producers a group refused:")
        _reasons([(t, f"`{_label(t)}`: {why}") for _, t, why in producers])
    left = sorted({op for r in report.RECORDS for op in r.fallback_ops})
    if left:
        print(f"  ops left to ATen in these graphs: {', '.join(left)}")
    return 0


def _label(t: Term) -> str:
    return str(t.attr("target")) if t.op in ("aten", "call") else t.op


def _reasons(items: list[tuple[Term, str]]) -> None:
    """Each distinct reason once, most frequent first, with one term it was given for."""
    counts = Counter(why for _, why in items)
    example: dict[str, Any] = {}
    for t, why in items:
        example.setdefault(why, t)
    for why, n in counts.most_common(SHOWN):
        times = f" (x{n})" if n > 1 else ""
        print(f"    at `{render(example[why], 2)}`{times}: {why}")
    if len(counts) > SHOWN:
        print(f"    ... {len(counts) - SHOWN} more reason(s)")
