"""What happened to each compiled graph: rules fired, kernels, fallback ops.

The compiler appends one `GraphRecord` per graph to `RECORDS`. `report.json`
(docs/report.md) is written by the CLI at the end of a run, and by any
compilation given `out_dir`, after each graph, listing every graph compiled so
far into that folder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from .coverage import Coverage, measure, top_outside

if TYPE_CHECKING:  # engine/rewrite.py loads the rule engine, which a graph-cache load skips
    from .engine.rewrite import Explanation


@dataclass
class GraphRecord:
    name: str
    kind: str  # forward | backward | inference | export | region
    status: str = "compiled"  # compiled | fallback
    reason: str | None = None
    nodes_in: int = 0
    nodes_out: int = 0
    rules_fired: Counter[str] = field(default_factory=Counter)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    fallback_ops: Counter[str] = field(default_factory=Counter)
    stop_reason: str | None = None
    # What the layout phase did (passes/layout.py): conv_layout, counts, or why not.
    layout: dict[str, Any] = field(default_factory=dict)
    # CUDA-graph replay (runtime/cudagraphs.py): on/off and why, once decided.
    cudagraphs: str = ""
    # Inputs the graph updates in place after its kernels (aten/input_writes.py).
    input_writes: int = 0
    compile_seconds: float = 0.0
    # wall seconds per step: convert, each pass that ran, kernels, lower
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # C++ kernels found already built in the kernel cache (runtime/build.py)
    kernel_cache_hits: int = 0
    # Loaded from the graph cache (runtime/graph_cache.py): the rules and kernels
    # listed are those of the compilation that stored it.
    cached: bool = False
    files: dict[str, str] = field(default_factory=dict)
    # The `profile` option's timings (runtime/profile.py: GraphProfile), filled in as
    # the graph is called: report.json shows them as of its writing.
    profile: Any = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(replace(self, profile=None))  # the profile's to_json, not a deep copy
        d["profile"] = self.profile.to_json() if self.profile is not None else None
        d["rules_fired"] = dict(self.rules_fired)
        d["fallback_ops"] = dict(self.fallback_ops)
        aten_ops = sum(self.fallback_ops.values())
        kernel_ops = sum(k.get("replaced_ops", 0) for k in self.kernels)
        total = aten_ops + kernel_ops
        d["kernel_op_share"] = round(kernel_ops / total, 4) if total else 0.0
        d["coverage"] = self.coverage().to_json()
        return d

    def coverage(self) -> Coverage:
        """The share of the graph's counted ops run inside kernels (coverage.py); a
        graph that fell back runs none there."""
        kernels = self.kernels if self.status == "compiled" else []
        return measure((k.get("ops", {}) for k in kernels), self.fallback_ops)


RECORDS: list[GraphRecord] = []
_graph_ids = itertools.count()


def graph_name(kind: str) -> str:
    """A process-wide unique name for a compiled graph: g0_inference, g1_forward, ..."""
    return f"g{next(_graph_ids)}_{kind}"

# Per-rule statistics summed over every graph: name -> RuleStats (engine/rewrite.py).
RULE_STATS: dict[str, Any] = {}


# What the `explain` option watched, per graph compiled: (graph name, Explanation).
EXPLANATIONS: list[tuple[str, Explanation]] = []


def reset() -> None:
    RECORDS.clear()
    EXPLANATIONS.clear()
    RULE_STATS.clear()
    OUT_DIR_RECORDS.clear()


# The graphs compiled into each out_dir, in order: what its report.json lists.
OUT_DIR_RECORDS: dict[str, list[GraphRecord]] = {}


def report_data(records: list[GraphRecord], *, options: dict[str, Any],
                script: str | None = None, ahead_of_time: Any = None) -> dict[str, Any]:
    """The contents of report.json; every key is described in docs/report.md."""
    return {
        "rewritec": __version__,
        "script": script,
        "options": {k: v for k, v in options.items() if k != "out_dir"},
        "ahead_of_time": ahead_of_time,
        "graphs": [r.to_json() for r in records],
    }


def write_report(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write `data` to `path` as JSON atomically: a reader sees the old report or
    the new one, never half of one. Raises OSError."""
    target = Path(path)
    # Not mkstemp: its 0600 would make report.json private; this honours the umask.
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2, default=str))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record_in_out_dir(out_dir: str, rec: GraphRecord | None, options: dict[str, Any]) -> None:
    """Add `rec` (if any) to the graphs of `out_dir` and rewrite its report.json."""
    key = os.path.abspath(out_dir)
    records = OUT_DIR_RECORDS.setdefault(key, [])
    if rec is not None and rec not in records:
        records.append(rec)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_report(Path(out_dir) / "report.json", report_data(records, options=options))



def add_rule_stats(stats: dict[str, Any]) -> None:
    for name, st in stats.items():
        total = RULE_STATS.get(name)
        if total is None:
            total = RULE_STATS[name] = type(st)()
        for f in ("tried", "matched", "rejected_guard", "rejected_meta", "gave_up", "fired",
                  "seconds"):
            setattr(total, f, getattr(total, f) + getattr(st, f))


def stats_table() -> str:
    """tried / matched / rejected / gave up (match budget) / fired / time per rule
    (REWRITEC_STATS=1)."""
    rows = [("rule", "tried", "matched", "rej. guard", "rej. type", "gave up", "fired", "ms")]
    for name, st in sorted(RULE_STATS.items(), key=lambda kv: -kv[1].seconds):
        rows.append((name, str(st.tried), str(st.matched), str(st.rejected_guard),
                     str(st.rejected_meta), str(st.gave_up), str(st.fired),
                     f"{1000 * st.seconds:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def summary_table(records: list[GraphRecord]) -> str:
    """One row per graph; `in kernels` is its coverage share (coverage.py), and the
    ops its kernels leave outside are listed under the table, commonest first."""
    rows = [("graph", "status", "ops in", "ops out", "rules fired", "kernels", "ATen ops",
             "in kernels")]
    outside = []
    for r in records:
        cov = r.coverage()
        status = f"{r.status} (cached)" if r.cached else r.status
        share = "-" if cov.share is None else f"{100 * cov.share:.0f}%"
        rows.append((r.name, status, str(r.nodes_in), str(r.nodes_out),
                     str(sum(r.rules_fired.values())), str(len(r.kernels)),
                     str(sum(r.fallback_ops.values())), share))
        if cov.outside:
            outside.append(f"outside kernels: {r.name}: {top_outside(cov, 5)}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fired: Counter[str] = Counter()
    for r in records:
        fired.update(r.rules_fired)
    if fired:
        lines.append("")
        lines.append("rules fired: " + ", ".join(f"{k} x{v}" for k, v in fired.most_common()))
    if outside:
        lines.append("")
        lines += outside
    for r in records:
        if r.status == "fallback":
            lines.append(f"fallback: {r.name}: {r.reason}")
    return "\n".join(lines)


def profile_table(graphs: list[dict[str, Any]], n: int = 10) -> str | None:
    """The `n` kernels and ATen calls that took longest, over every graph's
    `profile` (report.json's form); None when nothing was measured."""
    rows = [(g["name"], kind, name, e) for g in graphs if g.get("profile")
            for kind, key in (("kernel", "kernels"), ("ATen", "aten"))
            for name, e in g["profile"][key].items()]
    if not rows:
        return None
    rows.sort(key=lambda r: -r[3]["total_s"])
    table = [("graph", "", "kernel or op", "calls", "total ms", "median us", "first ms",
              "of graph")]
    for graph, kind, name, e in rows[:n]:
        median = "-" if e["median_s"] is None else f"{1e6 * e['median_s']:.1f}"
        first = "-" if e["first_s"] is None else f"{1e3 * e['first_s']:.3f}"
        share = "-" if e["share"] is None else f"{100 * e['share']:.1f}%"
        table.append((graph, kind, name, str(e["calls"]), f"{1e3 * e['total_s']:.3f}",
                      median, first, share))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (f"top {min(n, len(rows))} by measured time (first: the first call, which "
            "loads or compiles the kernel; of graph: share of its measured time)\n"
            + "\n".join(lines))
