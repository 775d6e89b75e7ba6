"""The kernel-variants pass: each kernel's kind picks the variant that runs it on the
target, and the variant's named kernel rewrites apply.

A row too wide for registers runs as `row_looped` on Triton (kinds/row.py), a
pointwise kernel whose input and output disagree on the innermost dim as
`pointwise_tiled` (kinds/pointwise.py). The pass rewrites the kernel term's `kind`,
so the final graph shows which variant runs, and runtime/prepare.py renders
whatever kind the term names (a variant takes its spec from its `base` kind).
Then each of the running kind's `rewrites` (kinds/kind.py: KernelRewrite) that
applies marks the kernel term with its name, a firing the report counts and the
trace shows, as a rule's: `welford-variance` (kinds/row_looped.py) computes a
looped row's variance in its mean's pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ..engine.pipeline import Context
from ..engine.term import Graph, Term, TermStore, rebuild
from . import registry
from .kind import Kind


def variants_for(target: str, store: TermStore
                 ) -> Callable[[Graph, Context], tuple[Graph, str]]:
    """The pass for `target`: (graph, ctx) -> (graph, summary), as engine/pipeline.py
    runs it; its rewrites are recorded through `ctx.rewrote`."""

    def run(graph: Graph, ctx: Context) -> tuple[Graph, str]:
        chosen: Counter[str] = Counter()  # variants, then named rewrites
        moved: dict[Term, Term] = {}

        def replace(t: Term, new: dict[Term, Term]) -> Term | None:
            if t.op != "kernel":
                return None
            kind = registry.kind(t.attr("kind"))
            if kind.spec is None or target not in kind.launchers:
                return None
            variant = kind.variant(kind.spec(t, 0), target)
            args = [new.get(a, a) for a in t.args]
            if variant is not None:
                chosen[variant] += 1
                kind = registry.kind(variant)
            attrs = tuple((k, kind.name if k == "kind" else v) for k, v in t.attrs)
            made = store.make("kernel", args, attrs, meta=t.meta)
            made = _rewritten(made, kind, store, ctx, chosen)
            return None if made is t else made

        graph = rebuild(graph, store, replace, moved)
        ctx.moved(moved)
        summary = ", ".join(f"{n} {name}" for name, n in sorted(chosen.items())) or "none"
        return graph, summary

    return run


def _rewritten(kernel: Term, kind: Kind, store: TermStore, ctx: Context,
               count: Counter[str]) -> Term:
    """`kernel` after each of its kind's named rewrites that applies, each recorded
    as a firing."""
    for rw in kind.rewrites:
        if rw.name in kernel.attr("rewrites", ()) or not rw.applies(kernel):
            continue
        done = (*kernel.attr("rewrites", ()), rw.name)
        attrs = (*((k, v) for k, v in kernel.attrs if k != "rewrites"), ("rewrites", done))
        after = store.make("kernel", kernel.args, attrs, meta=kernel.meta)
        ctx.rewrote(rw.name, rw.location, kernel, after)
        count[rw.name] += 1
        kernel = after
    return kernel
