"""Checking a user's op (`ops:` in a rule file) against its ATen overload.

Before a user's op is used, each of its ATen overloads must exist and run, and
each kernel expression it gives (`triton:`, `cpp:`) is rendered into a kernel of
its own, built, run on sample values (ordinary numbers, signed zeros, the
smallest and largest, inf, -inf and nan) and compared with the ATen overload:
nan and infinities where ATen has them, finite values within a few roundings
(rulecheck.py: SIMPLIFY_ULPS). The package's ops are held to the same by the test
suite (tests/test_opinfo.py, the differential fuzzer).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TextIO

import torch

from .engine import syntax as S
from .engine.errors import RewritecError, RuleError, RuleErrors
from .engine.ops import OpInfo, OpTable
from .engine.pattern import Builder
from .engine.pipeline import run_pipeline
from .engine.rules import ATTR_FUNCS, Rule
from .engine.term import Graph, TermStore
from .kinds.kernels import compilable
from .kinds.registry import SPACES
from .kinds.variants import variants_for
from .aten.bridge import Bridge, meta_of, overload
from .rulecheck import SIMPLIFY_ULPS, _difference, _float_probes
from .runtime.build import cxx
from .runtime.prepare import prepare_kernels
from .runtime.wrapper import lower


def op_targets() -> list[str]:
    """The kernel targets this machine can run an op's expression on: OpenMP where
    there is a C++ compiler, Triton on a GPU or under TRITON_INTERPRET=1."""
    targets = ["openmp"] if cxx() else []
    try:
        import triton  # noqa: F401
    except ImportError:
        return targets
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        targets.append("triton")
    return targets


def op_report(op: OpInfo, table: OpTable, fuse: Rule) -> tuple[list[str], list[str]]:
    """(problems, targets checked) for one user op; `fuse` is the package's
    fuse-pointwise rule, which puts the op in a kernel alone here."""
    for name, _ in op.overloads():
        try:
            overload(name)
        except (AttributeError, RuntimeError):
            return [f"no ATen overload {name}"], []
    if op.category != "pointwise":
        return [], []
    checked, problems = [], []
    for target in op_targets():
        if getattr(op, "triton" if target == "triton" else "cpp") is None:
            continue
        checked.append(target)
        try:
            found = _compare(op, table, fuse, target)
        except (RewritecError, RuntimeError, TypeError, ValueError, KeyError) as e:
            found = f"{type(e).__name__}: {e}"
        if found:
            problems.append(f"{target}: {found}")
    return problems, checked


def _inputs(op: OpInfo, device: str) -> list[torch.Tensor]:
    """f32 operands holding every pair of sample values (one operand: each value)."""
    values = torch.tensor(_float_probes(torch.float32, extremes=True), dtype=torch.float32)
    n = len(op.args)
    if n == 1:
        return [values.to(device)]
    grids = torch.meshgrid(*([values] * min(n, 2)), indexing="ij")
    flat = [g.reshape(-1) for g in grids]
    flat += [flat[k % 2] for k in range(2, n)]  # a third operand repeats the others
    return [f.contiguous().to(device) for f in flat]


def _compare(op: OpInfo, table: OpTable, fuse: Rule, target: str) -> str | None:
    device = "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"
    values = _inputs(op, device)
    bridge = Bridge(table=table)
    store = TermStore(bridge.meta_hook)
    env: dict[str, Any] = {}
    inputs = []
    for k, (name, value) in enumerate(zip(op.args, values, strict=True)):
        fake = bridge.fake_mode.from_tensor(value, static_shapes=True)
        term = store.make("input", (), (("name", name), ("index", k), ("kind", "input")),
                          meta=meta_of(fake))
        inputs.append(term)
        env[name] = term
    call = S.parse_expr(f"{op.name}({', '.join(op.args)})", op.where)
    root = Builder(table, store, ATTR_FUNCS).term(call, env)
    graph = Graph(tuple(inputs), (root,))
    result = run_pipeline(graph, store, [fuse], table=table,
                          can_compile=compilable(target, table), spaces=SPACES,
                          variants=variants_for(target, store))
    if not result.fired.get(fuse.name):
        return "no kernel computes it (its expression does not apply at f32)"
    prepared = prepare_kernels(result.graph, store, target, strict=True, out_dir=None,
                               name=f"op_{op.name}", bridge=bridge)
    want = lower(graph, bridge, f"op_{op.name}_aten").fn(list(values))[0]
    got = lower(prepared.graph, bridge, f"op_{op.name}_kernel",
                launchers=prepared.launchers).fn(list(values))[0]
    diff = _difference(got.cpu(), want.cpu(), SIMPLIFY_ULPS)
    if diff is None:
        return None
    phrase, i = diff
    at = ", ".join(f"{n}={v.reshape(-1)[i].item()!r}" for n, v in zip(op.args, values,
                                                                          strict=True))
    return f"parts from ATen's {op.aten[0]} at {at}: {phrase}"


def single_op_rule(fuse_pointwise: Rule) -> Rule:
    """The package's fuse-pointwise rule without its `ops >= 2` guard: one op, one
    kernel."""
    return dataclasses.replace(fuse_pointwise, name="op-check", guards=())


def check_ops(ops: list[OpInfo], table: OpTable, library: list[Rule], out: TextIO) -> int:
    """`rewritec rules check`: one line per user op (rulesets.py: user_ops), as for
    rules; the count that fail."""
    if not ops:
        return 0
    fuse = single_op_rule(next(r for r in library if r.name == "fuse-pointwise"))
    failed = 0
    for op in ops:
        problems, targets = op_report(op, table, fuse)
        status = "FAIL" if problems else "ok"
        checked = "vs ATen: " + (", ".join(targets) or "no kernel target")
        out.write(f"{status:<4} op {op.name:<25} {checked:<18} {op.where}\n")
        for p in problems:
            out.write(f"     {op.where}: [{op.name}] {p}\n")
        failed += bool(problems)
    out.write(f"\n{len(ops) - failed} ok, {failed} failed, {len(ops)} user ops\n\n")
    return failed


def verify_user_ops(ops: list[OpInfo], table: OpTable, library: list[Rule]) -> None:
    """Reject, with its file:line, each user op whose overloads do not exist or whose
    kernel expressions part from ATen (see op_report)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not ops:
        return
    fuse = single_op_rule(next(r for r in library if r.name == "fuse-pointwise"))
    errors = []
    for op in ops:
        with unset_fake_temporarily():  # the first compilation loads under fake mode
            problems, _ = op_report(op, table, fuse)
        if problems:
            errors.append(RuleError(f"op fails its check, not used: {problems[0]}", op.where))
    if errors:
        raise RuleErrors(errors)
