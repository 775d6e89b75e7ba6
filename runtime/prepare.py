"""Turning the `kernel` terms of a graph into launchers (runtime/launch.py).

For each kernel term: build its `KernelSpec`, render it for the target, build
it through the cache and wrap it in its launcher. A kernel that fails to render
or build is replaced by its body again, so that group runs through ATen, with a
warning naming the rule and template (`strict` raises).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..aten.bridge import Bridge
from ..engine.diag import user_stacklevel
from ..engine.errors import CompileError
from ..engine.fuse import body_terms, kernel_outputs
from ..engine.ops import OpTable
from ..engine.term import Graph, Term, TermStore, rebuild
from ..kinds import registry
from ..kinds.kernels import RenderError, template_shown
from ..kinds.spec import KernelSpec
from . import ahead
from .build import CACHE_HITS, BudgetSpent, BuildError, budget, vector_math_decls
from .launch import KernelFallback, Result
from .recipe import KernelRecipe


@dataclass
class Prepared:
    graph: Graph
    launchers: dict[Term, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    failed: int = 0  # kernels that went back to their ATen body
    # why each of those did: rule, location, template, error, the ops it held
    failures: list[dict[str, Any]] = field(default_factory=list)
    cache_hits: int = 0  # C++ kernels found built in the kernel cache
    names: dict[Term, str] = field(default_factory=dict)  # kernel term -> its name


def aten_body(kernel: Term, bridge: Bridge) -> AtenBody:
    """The kernel's group run op by op through ATen (the launch-failure fallback)."""
    return AtenBody(body_terms(kernel), kernel_outputs(kernel), bridge)


class AtenBody:
    """A kernel's group run op by op through ATen: called with the kernel's inputs,
    it returns its one output, or the tuple of all of them, as the launcher does.
    A package stores it as a program (runtime/program.py: `encode_body`)."""

    def __init__(self, body: Sequence[Term], outputs: Sequence[Term], bridge: Bridge) -> None:
        self.body = body
        self.order = [t for t in body if t.op not in ("arg", "const")]
        self.outputs = outputs
        self.bridge = bridge

    def __call__(self, *inputs: torch.Tensor) -> Result:
        values: dict[Term, Any] = {}
        for t in self.body:
            if t.op == "arg":
                values[t] = inputs[t.attr("index")]
            elif t.op == "const":
                values[t] = t.value
        for t in self.order:
            values[t] = self.bridge.run(t, [values[a] for a in t.args])
        if len(self.outputs) == 1:
            return values[self.outputs[0]]  # type: ignore[no-any-return]
        return tuple(values[o] for o in self.outputs)


def prepare_kernels(graph: Graph, store: TermStore, target: str, *, strict: bool,
                    out_dir: str | None, name: str, bridge: Bridge | None = None,
                    warn: Callable[[str], None] | None = None,
                    contract: bool = False, budget_s: float | None = None,
                    autotune: bool = False) -> Prepared:
    """Build every kernel term of `graph`; failed ones go back to their ATen body.
    `contract` (fast_math) lets the kernels' compiler fuse multiply-adds; the
    builds share `budget_s` seconds of compiler time, and once it is spent the
    kernels left fall back together, with one warning. `autotune` (mode
    max-autotune) times Triton kernels' launch configurations (runtime/autotune.py)."""
    hits = CACHE_HITS[0]
    with budget(budget_s):
        prepared = _prepare(graph, store, target, strict=strict, out_dir=out_dir, name=name,
                            bridge=bridge, warn=warn, contract=contract, budget_s=budget_s,
                            autotune=autotune)
    prepared.cache_hits = CACHE_HITS[0] - hits
    return prepared


def _prepare(graph: Graph, store: TermStore, target: str, *, strict: bool,
             out_dir: str | None, name: str, bridge: Bridge | None,
             warn: Callable[[str], None] | None, contract: bool,
             budget_s: float | None, autotune: bool = False) -> Prepared:
    prepared = Prepared(graph)
    bridge = bridge or Bridge()
    table = bridge.table  # the compilation's ops: the package's and the user's
    failed: dict[Term, tuple[Term, ...]] = {}
    order = graph.terms()
    spent: list[str] = []  # the kernels left when the budget ran out
    say = warn or (lambda m: warnings.warn(m, KernelFallback,
                                           stacklevel=user_stacklevel()))
    for t in order:
        if t.op != "kernel":
            continue
        index = len(prepared.launchers) + len(failed)
        if spent:
            spent.append(str(t.attr("rule")))
            failed[t] = inline_body(t, store)
            prepared.failures.append(_failure(t, target, "the compile budget is spent"))
            continue
        try:
            spec, source, launcher_name = _render(t, index, target, table)
            spec.autotune = autotune and target == "triton"
            recipe = KernelRecipe(target, source, launcher_name, contract)
            launcher, path = recipe.build(spec, aten_body(t, bridge))
        except BudgetSpent as e:
            if strict:
                raise CompileError(f"rewritec: graph {name}: {e}") from None
            spent.append(str(t.attr("rule")))
            failed[t] = inline_body(t, store)
            prepared.failures.append(_failure(t, target, str(e)))
            continue
        except (RenderError, BuildError, KeyError, ValueError) as e:
            message = (f"rewritec: kernel for rule {t.attr('rule')} @ {t.attr('location')} "
                       f"(template {target}/{t.attr('kind')}) falls back to ATen: {e}")
            if strict:
                raise CompileError(message) from None
            say(message)
            failed[t] = inline_body(t, store)
            prepared.failures.append(_failure(t, target, str(e)))
            continue
        launcher.strict = strict
        prepared.launchers[t] = launcher
        prepared.names[t] = spec.name
        if out_dir:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            ext = "py" if target == "triton" else "cpp"
            copy = out / f"{name}.{spec.name}.{ext}"
            copy.write_text(source)
            path = copy
        prepared.records.append({"name": spec.name, "target": target, "source": str(path),
                                 "rules": [spec.rule],
                                 "kind": spec.template,
                                 "matrix_products": registry.kind(spec.template)
                                 .matrix_products,
                                 "template": _template_record(spec, target),
                                 "replaced_ops": spec.replaced_ops,
                                 "outputs": len(spec.outputs),
                                 "ops": body_ops(spec),
                                 "order": spec.meta.get("order")})
    if spent:
        say(f"rewritec: graph {name}: the compile budget ({budget_s:g} s, "
            f"REWRITEC_COMPILE_BUDGET) is spent; {len(spent)} kernel(s) left fall back "
            f"to ATen (rules {', '.join(sorted(set(spent)))})")
    if failed:
        prepared.graph = _substitute(graph, store, failed)
        prepared.failed = len(failed)
    if target == "triton" and prepared.launchers:
        # where workers run, they compile the kernels while the graph is finished
        ahead.submit_graph(prepared.graph, prepared.launchers)
    return prepared


def _failure(kernel: Term, target: str, error: str) -> dict[str, Any]:
    """What the report says of a kernel that went back to ATen."""
    ops = Counter(t.op for t in body_terms(kernel) if t.op not in ("arg", "const"))
    return {"rule": kernel.attr("rule"), "location": kernel.attr("location"),
            "template": f"{target}/{kernel.attr('kind')}", "error": error,
            "ops": dict(ops)}


def _template_record(spec: KernelSpec, target: str) -> str:
    """report.json's `template`: `target/name`, or the file of a user's template."""
    shown = template_shown(spec, target)
    return f"{target}/{spec.template}" if shown.startswith("templates/") else shown


def body_ops(spec: KernelSpec) -> dict[str, int]:
    """op-table name -> how many of it the kernel computes: what `coverage`
    (coverage.py) counts inside kernels."""
    ops = Counter(t.op for t in spec.body if t.op not in ("arg", "const"))
    return dict(sorted(ops.items()))


def _render(term: Term, index: int, target: str, table: OpTable) -> tuple[KernelSpec, str, str]:
    """A kernel term's spec, its source for `target` and its launcher's name, all
    from the kind it names (kinds/registry.py; a variant, which the variants pass
    chose, takes its spec from its base kind)."""
    kind = registry.kind(term.attr("kind"))
    base = registry.kind(kind.base) if kind.base is not None else kind
    if target not in kind.launchers or base.spec is None:
        raise RenderError(f"no {target} template for {kind.name}")
    spec = base.spec(term, index)
    # the variant's: its launch is the one tuned
    spec.tuning = kind.tuning.name if kind.tuning is not None else None
    simd = vector_math_decls() if target == "openmp" else ()
    return spec, kind.render(spec, target, simd, table), kind.launchers[target]


def inline_body(kernel: Term, store: TermStore) -> tuple[Term, ...]:
    """The kernel's computation as ordinary terms over its operands: one term per
    output (engine/fuse.py: kernel_outputs)."""
    done: dict[Term, Term] = {}
    for t in body_terms(kernel):
        if t.op == "arg":
            done[t] = kernel.args[t.attr("index")]
        elif t.op == "const":
            done[t] = t
        else:
            done[t] = store.make(t.op, [done[a] for a in t.args], t.attrs, meta=t.meta)
    return tuple(done[o] for o in kernel_outputs(kernel))


def _substitute(graph: Graph, store: TermStore, repl: dict[Term, tuple[Term, ...]]) -> Graph:
    """`graph` with each failed kernel replaced by its body over the new terms: a
    kernel of one output by that output's term, `getitem(kernel, i)` of one with
    side outputs by output i's (the kernel itself is then used no more)."""

    def inlined(term: Term, new: dict[Term, Term]) -> Term:
        memo: dict[Term, Term] = {}
        for u in term.walk():
            if u in new:
                memo[u] = new[u]
            elif u.args:
                memo[u] = store.make(u.op, [memo[a] for a in u.args], u.attrs, meta=u.meta)
            else:
                memo[u] = u
        return memo[term]

    def replace(t: Term, new: dict[Term, Term]) -> Term | None:
        outputs = repl.get(t)
        if outputs is not None and len(outputs) == 1:
            return inlined(outputs[0], new)
        if t.op == "getitem" and t.args[0] in repl:
            return inlined(repl[t.args[0]][t.attr("index")], new)
        return None

    return rebuild(graph, store, replace)
