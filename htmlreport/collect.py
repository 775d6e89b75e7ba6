"""What the HTML report needs of one graph, gathered while it compiles.

Only a compilation with `out_dir` calls this (compiler.py: _write_artifacts);
the result is written as `<graph>.details.json`, so `rewritec report DIR`
rebuilds the page from the folder alone. Torch-free: it reads terms.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..coverage import op_class
from ..engine.ops import default_op_table
from ..engine.trace import Firing, Trace
from ..engine.term import Graph, Term, render

if TYPE_CHECKING:
    from ..runtime.prepare import Prepared

# Firings kept per graph (12 GPT-2 blocks fire about 250 times in each direction):
# a bound, so that a rule run wild cannot make the page unusable.
MAX_FIRINGS = 5000
# Rule files live here when their location is relative (the built-in library).
_PACKAGE = Path(__file__).resolve().parent.parent
NOT_OPS = frozenset({"input", "const", "getitem", "kernel", "tensor", "arg"})


def graph_details(captured: Graph, final: Graph, trace: Trace, prepared: Prepared | None,
                  can_compile: Callable[[Term], bool] | None, target: str) -> dict[str, Any]:
    """The JSON-able details of one compiled graph (htmlreport/page.py reads them)."""
    names: dict[Term, str] = dict(prepared.names) if prepared is not None else {}
    failures: list[dict[str, Any]] = list(prepared.failures) if prepared is not None else []
    firings = trace.firings
    in_kernel: dict[Term, str] = {}  # a term the fuse phase saw -> its kernel
    for f in firings:
        if f.after in names:  # a kernel that failed to build runs nothing
            in_kernel.update((m, names[f.after]) for m in f.members)

    def kernel_of(t: Term) -> str | None:  # a captured term -> the kernel it runs in
        now = trace.became.get(t, t)
        return in_kernel.get(now) or _kernel_name(now, names)

    made_by = _producers(firings)
    rewritten_by: dict[Term, str] = {}
    for f in firings:
        rewritten_by.setdefault(f.before, f"{f.rule} @ {f.location}")
    why = _fallback_reasons(failures, trace.refused, can_compile, target)
    runs = set(final.terms())

    def captured_why(t: Term) -> str | None:  # a captured op still there, run by ATen
        now = trace.became.get(t, t)
        return why(now) if now in runs and now.op == t.op else None

    return {
        "target": target,
        "captured": _nodes(captured, kernel_of, rewritten_by, "rewritten by", captured_why),
        "final": _nodes(final, lambda t: _kernel_name(t, names), made_by, "made by", why),
        "firings": [_firing(f, names) for f in firings[:MAX_FIRINGS]],
        "firings_total": len(firings),
        "rule_text": rule_texts({f.location for f in firings}),
        "kernels": {name: {"rule": k.attr("rule"), "location": k.attr("location")}
                    for k, name in names.items()},
        "fallbacks": _fallback_table(final, why),
        "kernel_failures": failures,
    }


def _kernel_name(t: Term, names: dict[Term, str]) -> str | None:
    if t.op == "kernel":  # one that failed to build has no name: it runs nothing
        return names.get(t)
    if t.op == "getitem" and t.args and t.args[0].op == "kernel":
        return _kernel_name(t.args[0], names)
    return None


def _producers(trace: list[Firing]) -> dict[Term, str]:
    """term -> the rule that built it: every term a replacement holds that is newer
    than the term it replaced (uids grow as terms are made)."""
    made: dict[Term, str] = {}
    for f in trace:
        who = f"{f.rule} @ {f.location}"
        stack = [f.after]
        while stack:
            t = stack.pop()
            if t.uid <= f.before.uid or t in made or t.op == "const":
                continue
            made[t] = who
            if t.op != "kernel":
                stack.extend(t.args)
    return made


def _firing(f: Firing, names: dict[Term, str]) -> dict[str, Any]:
    if f.members:
        after = (f"kernel {names.get(f.after, '(fell back to ATen)')}: "
                 f"{len(f.members)} op(s), kind {f.after.attr('kind')}")
    else:
        after = render(f.after, 3)
    return {"phase": f.phase, "rule": f.rule, "location": f.location,
            "before": render(f.before, 3), "after": after}


def label(t: Term) -> str:
    """The op as the report names it: the ATen target for ops outside the table."""
    if t.op in ("aten", "call"):
        return str(t.attr("target"))
    if t.op == "input":
        return f"input {t.attr('name')}"
    return t.op


def _nodes(graph: Graph, kernel: Callable[[Term], str | None], rules: dict[Term, str],
           verb: str, why: Callable[[Term], str | None] | None) -> dict[str, Any]:
    """One entry per term (constants are inlined as their value); `rules` says
    which rule `verb` it ("made by", "rewritten by")."""
    table = default_op_table()
    nodes = []
    for t in graph.terms():
        if t.op == "const":
            continue
        meta = t.meta
        node: dict[str, Any] = {
            "id": t.uid, "op": label(t),
            "args": [a.uid for a in t.args if a.op != "const"],
            "consts": [repr(a.value)[:40] for a in t.args if a.op == "const"],
            "type": meta.short(), "dtype": meta.dtype if meta.kind == "tensor" else meta.kind,
            "shape": [str(s) for s in meta.shape], "strides": [str(s) for s in meta.strides],
            "cls": _class(t, table),
        }
        k = kernel(t)
        if k is not None:
            node["kernel"] = k
        if t in rules:
            node["rule"] = f"{verb} {rules[t]}"
        if t.op == "kernel":
            node["rule"] = f"made by {t.attr('rule')} @ {t.attr('location')}"
        reason = why(t) if why is not None and k is None else None
        if reason is not None:
            node["fallback"] = reason
        nodes.append(node)
    outputs = [o.uid for o in graph.outputs if o is not None]
    return {"nodes": nodes, "outputs": outputs}


def _class(t: Term, table: Any) -> str:
    """input, kernel, view, extern (a library call) or op (anything else)."""
    if t.op in ("input", "tensor"):
        return "input"
    if t.op == "kernel":
        return "kernel"
    if t.op == "getitem":
        return "view"
    info = table.get(t.op)
    if info is None:  # an ATen op outside the table: classed as coverage.py does
        return {"no_kernel": "view", "extern": "extern"}.get(op_class(_packet(t)), "op")
    return {"view": "view", "extern": "extern"}.get(info.category, "op")


def _fallback_reasons(failures: list[dict[str, Any]], refused: dict[Term, list[str]],
                      can_compile: Callable[[Term], bool] | None,
                      target: str) -> Callable[[Term], str | None]:
    """Why a term of the final graph runs through ATen; None for what is no op
    (inputs, kernels, tuple picks) and for views, which launch nothing."""
    table = default_op_table()
    failed = {op: f for f in failures for op in f["ops"]}

    def why(t: Term) -> str | None:
        if t.op in NOT_OPS:
            return None
        info = table.get(t.op)
        if info is None:
            cls = op_class(_packet(t))
            if cls == "no_kernel":
                return None
            if cls == "extern":
                return "library call (extern): ATen runs it by design"
            return ("unknown op: not in the op table (rules/ops.yaml), so no rule or "
                    "kernel covers it")
        if info.category == "view":
            return None
        if info.category == "extern":
            return "library call (extern): ATen runs it by design"
        if t.op in failed:
            f = failed[t.op]
            return (f"its kernel ({f['rule']} @ {f['location']}, template {f['template']}) "
                    f"failed to build: {f['error']}")
        if can_compile is None:
            return f"target {target}: no kernels are generated"
        if not can_compile(t):
            return (f"no {target} kernel computes it (its op, dtype or shape is outside "
                    "the templates)")
        if t in refused:
            return "fuse rules matched it but refused: " + "; ".join(refused[t])
        return ("no fuse rule matched it as a group's root, nor took it into one "
                "(`rewritec explain SCRIPT --rule fuse-pointwise` shows the closest)")

    return why


def _packet(t: Term) -> str:
    """An op outside the table named as `fallback_ops` names it (coverage.py):
    `linear` for aten.linear.default, `ns::name` for another namespace."""
    parts = str(t.attr("target")).split(".")
    if len(parts) < 2:
        return parts[0]
    return parts[1] if parts[0] == "aten" else f"{parts[0]}::{parts[1]}"


def _fallback_table(final: Graph, why: Callable[[Term], str | None]) -> list[dict[str, Any]]:
    """(op, reason) -> calls, commonest first."""
    counts: Counter[tuple[str, str]] = Counter()
    for t in final.terms():
        reason = why(t)
        if reason is not None:
            counts[(label(t), reason)] += 1
    return [{"op": op, "reason": reason, "count": n}
            for (op, reason), n in counts.most_common()]


def rule_texts(locations: set[str]) -> dict[str, str]:
    """`file:line` -> the YAML of the rule starting there (its list item)."""
    files: dict[str, list[str] | None] = {}
    out = {}
    for loc in sorted(locations):
        path, _, line = loc.rpartition(":")
        if not line.isdigit():
            continue
        if path not in files:
            files[path] = _read_lines(path)
        lines = files[path]
        if lines:
            out[loc] = rule_block(lines, int(line))
    return out


def _read_lines(path: str) -> list[str] | None:
    p = Path(path)
    for candidate in (p, _PACKAGE / p, _PACKAGE.parent / p):
        try:
            return candidate.read_text().splitlines()
        except OSError:
            continue
    return None


def rule_block(lines: list[str], line: int) -> str:
    """The YAML list item that starts on `line` (1-based): every line after it that
    is indented deeper, or blank."""
    if not 1 <= line <= len(lines):
        return ""
    first = lines[line - 1]
    indent = len(first) - len(first.lstrip())
    block = [first]
    for text in lines[line:]:
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            break
        block.append(text)
    while block and not block[-1].strip():
        block.pop()
    return "\n".join(block)
