"""The kernel-variants pass: each kernel's kind picks the variant that runs it on the target.

A row too wide for registers runs as `row_looped` on Triton (kinds/row.py), a
pointwise kernel whose input and output disagree on the innermost dim as
`pointwise_tiled` (kinds/pointwise.py). The pass rewrites the kernel term's `kind`,
so the final graph shows which variant runs, and runtime/prepare.py renders
whatever kind the term names (a variant takes its spec from its `base` kind).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..engine.term import Graph, Term, TermStore, rebuild
from . import registry


def variants_for(target: str, store: TermStore) -> Callable[[Graph], tuple[Graph, str]]:
    """The pass for `target`: graph -> (graph, summary), as engine/pipeline.py runs it."""

    def run(graph: Graph) -> tuple[Graph, str]:
        chosen: Counter[str] = Counter()

        def replace(t: Term, new: dict[Term, Term]) -> Term | None:
            if t.op != "kernel":
                return None
            kind = registry.kind(t.attr("kind"))
            if kind.spec is None or target not in kind.launchers:
                return None
            variant = kind.variant(kind.spec(t, 0), target)
            if variant is None:
                return None
            chosen[variant] += 1
            attrs = tuple((k, variant if k == "kind" else v) for k, v in t.attrs)
            return store.make("kernel", [new.get(a, a) for a in t.args], attrs, meta=t.meta)

        graph = rebuild(graph, store, replace)
        summary = ", ".join(f"{n} {name}" for name, n in sorted(chosen.items())) or "none"
        return graph, summary

    return run
