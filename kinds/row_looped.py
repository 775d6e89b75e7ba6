"""The looped (multi-pass) Triton row kernel, for rows too wide to keep in registers.

The persistent `row` template holds a whole row (BLOCK_C >= cols values per
live row-sized temporary) in registers. Past PERSISTENT_ROW_MAX_COLS columns
that spills: on an H200 a 32K-wide f32 layer_norm ran at 40% of copy
bandwidth. This variant keeps one program per row but reads the row in chunks
of BLOCK_C: one loop per reduction, recomputing only the element values that
reduction needs, then a last loop computing and storing the outputs. It is
the structure of the OpenMP row kernel (kinds/row.py); the extra passes re-read
the row, mostly from L2.

Its named rewrites, which the variants pass applies and records, each save a read
of the row:
- `welford-variance` (WELFORD): a variance of a mean, mean((e - m) * (e - m)) with
  m = mean(e), is computed in m's pass with Welford's updates;
- `online-softmax` (ONLINE): a softmax's denominator, sum(exp(e - m)) with
  m = amax(e), is computed in m's pass, each lane's sum rescaled when its maximum
  grows (a cross entropy over GPT-2's 50257-wide rows reads them twice, not three
  times).
"""

from __future__ import annotations

from typing import Any

from ..engine.fuse import ROW_REDUCTIONS, body_terms, reduced_dim
from ..engine.ops import OpTable, default_op_table
from ..engine.term import Term
from .kernels import (
    TRITON_DTYPES,
    kernel_header,
    load_cast,
    per_row,
    print_index,
    row_width_param,
    strided_offset,
    term_names,
    value_expr,
)
from .reduction import triton_accumulate, triton_finish, triton_init
from .kind import Kind, KernelRewrite
from .spec import KernelSpec, KInput, size_params, static_width
from .templates import render_template
from .tuning import LoopedRowTuning

# Widest row (static columns) the persistent template takes. Wider rows loop.
# With the width a compile-time constant (kernels.row_width_param), a looped
# kernel reading a row as one chunk, twice (once for the statistics, again,
# mostly from L1/L2, for the outputs), beat holding the row in registers from 4K
# columns. H200, f32, benchmarks/row_variants.py, looped / persistent / Inductor ms:
#   1024 rows of 32K: layer_norm 0.081 / 0.158 / 0.086, rms_norm 0.071 / 0.092 /
#   0.071, softmax 0.076 / 0.086 / 0.101;
#   8192 rows of 4K: layer_norm 0.0695 / 0.0712 / 0.0682, rms_norm 0.0673 / 0.0702 /
#   0.0677, softmax 0.0686 / 0.0697 / 0.0850;
#   32768 rows of 1K: equal within 1%. 2K is unmeasured.
PERSISTENT_ROW_MAX_COLS = 2048
# Cache hints: the passes before the last read the row to keep it in L2
# (evict_last), the last pass reads it for the last time (evict_first); a row that
# every row shares (layer_norm's weight and bias) is always evict_last.
EVICTION_HINTS = True
# The last pass walks the chunks in order. Walking them from the last (the chunks
# read most recently are likelier in L1/L2) was measured on the H200 and dropped: it
# won 1-5% for some chunk sizes and lost as much for others.


def looped(spec: KernelSpec) -> bool:
    """Whether a Triton row kernel loops over its rows: they are wide, or their
    width is symbolic (one kernel serves every width, so plan for wide ones)."""
    cols = static_width(spec)
    return cols is None or cols > PERSISTENT_ROW_MAX_COLS


def _variance_of(t: Term) -> Term | None:
    """The mean m when `t` is sum or mean of (e - m) * (e - m) along the row with
    m = mean(e) (layer_norm's variance, as rules/decompose/norms.yaml writes it)."""
    if t.op not in ("sum", "mean") or t.args[0].op != "mul":
        return None
    a, b = t.args[0].args
    if a is not b or a.op != "sub" or a.attr("alpha", 1) != 1:
        return None
    e, m = a.args
    if m.op != "mean" or m.args[0] is not e or m.attr("dim") != t.attr("dim"):
        return None
    return m


def welford_terms(body: list[Term]) -> dict[Term, Term]:
    """Each variance the welford-variance rewrite computes in its mean's pass -> that
    mean: mean((e - m) * (e - m)) (or the sum) where m = mean(e) is a pass of its own
    (not itself such a variance), in body order as render_row_looped plans passes."""
    means: set[Term] = set()
    found: dict[Term, Term] = {}
    for t in body:
        m = _variance_of(t)
        if m is not None and m in means:
            found[t] = m
        elif t.op == "mean":
            means.add(t)
    return found


WELFORD = KernelRewrite(
    name="welford-variance",
    doc="mean((e - m) * (e - m)) with m = mean(e) along a looped row -> computed in m's "
        "pass with Welford's updates (one read of the row fewer; exact 0 for equal values)",
    location="kinds/row_looped.py",
    applies=lambda kernel: bool(welford_terms(body_terms(kernel))))


def _exp_sum_of(t: Term) -> Term | None:
    """The maximum m when `t` is sum(exp(e - m)) along the row with m = amax(e)
    (softmax's and log_softmax's denominator, as rules/decompose/norms.yaml writes it)."""
    if t.op != "sum" or t.args[0].op != "exp" or reduced_dim(t) is None:
        return None
    d = t.args[0].args[0]
    if d.op != "sub" or d.attr("alpha", 1) != 1:
        return None
    e, m = d.args
    if m.op != "amax" or m.args[0] is not e or reduced_dim(m) != reduced_dim(t):
        return None
    return m


def online_terms(body: list[Term]) -> dict[Term, Term]:
    """Each exp-sum the online-softmax rewrite computes in its maximum's pass -> that
    maximum (a row reduction of the body, so a pass of its own)."""
    found: dict[Term, Term] = {}
    for t in body:
        m = _exp_sum_of(t)
        if m is not None:
            found[t] = m
    return found


ONLINE = KernelRewrite(
    name="online-softmax",
    doc="sum(exp(e - m)) with m = amax(e) along a looped row -> computed in m's pass, "
        "each lane's sum rescaled as its maximum grows (one read of the row fewer)",
    location="kinds/row_looped.py",
    applies=lambda kernel: bool(online_terms(body_terms(kernel))))


def _online_pass(p: dict[str, Any], m: str, s: str, e: str, compute: str) -> None:
    """Turn pass `p`, the maximum `m` of the element values `e`, into one that also
    sums exp(e - m) as `s`: per lane, the running sum is rescaled by exp(old max -
    new max) when the max grows; the lanes merge at their common max. Lanes that
    saw only -inf add 0; a row whose max is -inf sums to nan, as exp(-inf - -inf)
    makes the two-pass sum nan."""
    acc = f"{m}_acc"
    p["what"] = f"max of {e} and sum of exp({e} - max) (online)"
    p["init"] = p["init"] + [f"{s}_acc = tl.zeros([BLOCK_C], {compute})"]
    p["body"] = p["elem"] + [
        f"{m}_e = tl.where(mask, {e}, float('-inf'))",
        f"{m}_new = tl.maximum({acc}, {m}_e, propagate_nan=tl.PropagateNan.ALL)",
        f"{m}_none = {m}_new == float('-inf')",
        f"{s}_acc = {s}_acc * tl.where({m}_none, 0.0, tl.exp({acc} - {m}_new)) + "
        f"tl.where({m}_none, 0.0, tl.exp({m}_e - {m}_new))",
        f"{acc} = {m}_new"]
    p["after"] += [
        f"{s} = tl.sum({s}_acc * tl.where({acc} == float('-inf'), 0.0, tl.exp({acc} - {m})), "
        "axis=0)",
        f"{s} = tl.where({m} == float('-inf'), float('nan'), {s})"]


def render_row_looped(spec: KernelSpec, table: OpTable | None = None) -> str:
    table = table or default_op_table()
    names = term_names(spec)
    compute = TRITON_DTYPES[spec.compute]

    def load(inp: KInput, idx: int, last: bool = False) -> str:
        row = print_index(strided_offset(spec.rank, inp.name, "row", skip_last=True), "triton")
        cast = load_cast(inp.dtype, compute)
        if inp.per_row:
            return f"x{idx} = tl.load({inp.name}_ptr + {'row' if inp.flat else row}){cast}"
        off = "row * n_cols + cols" if inp.flat else \
            f"{row} + cols * {inp.name}_stride{spec.rank - 1}"
        # rows shared by every row (weights) stay in cache; a row's own values leave
        # it on their last read
        hint = (f", eviction_policy='{'evict_first' if last and not inp.shared else 'evict_last'}'"
                if EVICTION_HINTS else "")
        return f"x{idx} = tl.load({inp.name}_ptr + {off}, mask=mask, other=0{hint}){cast}"

    def stmt(t: Term) -> str:
        return f"{names[t]} = {value_expr(t, names, 'triton', table)}"

    done: set[Term] = {t for t in spec.body if t.op == "arg" and per_row(t, spec)}

    def elem_terms(targets: list[Term]) -> list[Term]:
        """Element values the targets need (loads included), in body order; the
        search stops at per-row values, which earlier passes computed."""
        need: set[Term] = set()
        stack = [t for t in targets if not per_row(t, spec)]
        while stack:
            t = stack.pop()
            if t not in need:
                need.add(t)
                stack += [a for a in t.args if a.op != "const" and not per_row(a, spec)]
        return [t for t in spec.body if t in need]

    def elem_lines(targets: list[Term], last: bool = False) -> list[str]:
        return [load(spec.inputs[t.attr("index")], t.attr("index"), last) if t.op == "arg"
                else stmt(t) for t in elem_terms(targets)]

    row_lines = [load(inp, k) for k, inp in enumerate(spec.inputs) if inp.per_row]
    welford = welford_terms(spec.body) if WELFORD.name in spec.meta.get("rewrites", ()) \
        else {}
    online = online_terms(spec.body) if ONLINE.name in spec.meta.get("rewrites", ()) \
        else {}
    passes: list[dict[str, Any]] = []
    pass_of: dict[Term, dict[str, Any]] = {}  # a mean or max -> the pass computing it
    for t in spec.body:
        if t.op in ("arg", "const") or t in done:
            continue
        top = online.get(t)
        if top is not None and top in pass_of:
            # the online-softmax rewrite (ONLINE): the max's pass sums exp(e - max) too
            _online_pass(pass_of[top], names[top], names[t], names[top.args[0]], compute)
            pass_of.pop(top)  # one sum a pass
            done.add(t)
            continue
        mean = welford.get(t)
        if mean is not None:
            # the welford-variance rewrite (WELFORD): the pass computing m computes both
            p = pass_of[mean]
            m, acc = names[mean], f"{names[mean]}_acc"
            e = names[mean.args[0]]
            p["what"] = f"mean and variance of {e} (Welford)"
            p["init"] = [f"{acc} = tl.zeros([BLOCK_C], {compute})",
                         f"{m}_m2 = tl.zeros([BLOCK_C], {compute})",
                         f"{m}_n = tl.zeros([BLOCK_C], {compute})"]
            p["body"] = p["elem"] + [f"{m}_n += tl.where(mask, 1.0, 0.0)",
                                     f"{m}_d = tl.where(mask, {e} - {acc}, 0.0)",
                                     f"{acc} += {m}_d / tl.maximum({m}_n, 1.0)",
                                     f"{m}_m2 += {m}_d * tl.where(mask, {e} - {acc}, 0.0)"]
            # the lanes' (mean, m2, count) merged pairwise (Chan's update): one
            # reduction, and lanes of one repeated value merge to an m2 of exactly 0
            p["after"][0:2] = [(f"{m}, {m}_m2s, {m}_ns = tl.reduce(({acc}, {m}_m2, {m}_n), 0, "
                                "_welford_combine)")]
            p["after"].insert(1, f"{names[t]} = {m}_m2s / n_cols" if t.op == "mean"
                              else f"{names[t]} = {m}_m2s")
            p["welford"] = True
            done.add(t)
            continue
        if t.op in ROW_REDUCTIONS:
            acc = f"{names[t]}_acc"
            after = [triton_finish(t.op, names[t], acc, 0)]
            if t.op == "mean":
                after.append(f"{names[t]} = {names[t]} / n_cols")
            elem = elem_lines([t.args[0]])
            passes.append({"what": f"{t.op} of {names[t.args[0]]}", "elem": elem,
                           "terms": elem_terms([t.args[0]]),
                           "init": triton_init(t.op, acc, "[BLOCK_C]", compute),
                           "body": elem + triton_accumulate(t.op, acc, names[t.args[0]], "mask"),
                           "after": after})
            if t.op in ("mean", "amax"):
                pass_of[t] = passes[-1]
            done.add(t)
        elif per_row(t, spec):
            (passes[-1]["after"] if passes else row_lines).append(stmt(t))
            done.add(t)
    stores: list[dict[str, Any]] = [
        {"ptr": f"{o.name}_ptr", "value": names[t], "dtype": TRITON_DTYPES[o.dtype],
         "per_row": o.per_row, "term": t} for o, t in zip(spec.outputs, spec.written, strict=True)]
    # An S-shaped side output is stored by the first pass that computes it, not
    # computed again in the last pass only to be stored
    stored: set[Term] = set()
    for p in passes:
        for o in stores[1:]:
            if not o["per_row"] and o["term"] in p["terms"] and o["term"] not in stored:
                stored.add(o["term"])
                p["body"].append(f"tl.store({o['ptr']} + row * n_cols + cols, "
                                 f"{o['value']}.to({o['dtype']}), mask=mask)")
    last = [o for o in stores if not o["per_row"] and o["term"] not in stored]
    elem_body = elem_lines([o["term"] for o in last], last=True)
    params = [f"{i.name}_ptr" for i in spec.inputs] + [f"{o.name}_ptr" for o in spec.outputs]
    params += [row_width_param(spec)]
    params += size_params(spec)
    params += [f"{i.name}_stride{k}" for i in spec.inputs if not i.flat for k in range(spec.rank)]
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"),
                           welford=any(p.get("welford") for p in passes),
                           name=spec.symbol, params=params, row_lines=row_lines, passes=passes,
                           elem_body=elem_body,
                           row_stores=[o for o in stores if o["per_row"]], elem_stores=last)


def _render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
            table: OpTable) -> str:
    return render_row_looped(spec, table)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"elem_body", "elem_stores", "header", "name", "params",
                         "passes", "row_lines", "row_stores", "welford"}),
}


KIND = Kind(name="row_looped", template_variables=TEMPLATE_VARIABLES,
            doc="a row kernel reading a row too wide for registers in chunks",
            base="row", render=_render, launchers={"triton": "LoopedRowTritonLauncher"},
            tuning=LoopedRowTuning(), rewrites=(WELFORD, ONLINE))
