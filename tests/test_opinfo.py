"""PyTorch's own OpInfo samples as an oracle: compiled by rewritec == eager.

Every op of `unary_ufuncs`, `binary_ufuncs` and `reduction_ops` (PyTorch's
test-suite database; `_refs.*` entries left out) runs its float32 CPU sample
inputs through `torch.compile(fn, backend="rewritec")` (default options:
target auto, so OpenMP kernels on CPU). Each sample must either match eager
or fall back cleanly (a `RewritecWarning` for a graph or a `KernelFallback`
for one kernel run by ATen instead, the result still equal to eager). An
exception or a wrong result is a failure - unless `aot_eager` (the same
capture with no compiler at all) fails on that sample too, which makes it a
limitation of the capture, not of rewritec ("peer fails too"). Ops rewritec
gets wrong today are xfail(strict=True) in `KNOWN_FAILURES`.

CI runs the first sample of every op (about 30 s); `REWRITEC_OPINFO=full`
runs three per op.
`test_opinfo_summary` (the last test of this file) prints the counts: ops
and samples tried, matched, fell back, failed, and the share of ops that
ran in generated kernels (`rewritec.report.RECORDS`). Run with `-s` to see it.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections import Counter
from statistics import mean
from typing import Any

import pytest
import torch
from rewritec import report
from rewritec.codegen.launch import KernelFallback
from rewritec.compiler import RewritecWarning

# Clean fallbacks: a graph (RewritecWarning) or one kernel (KernelFallback) run by ATen.
FALLBACK_WARNINGS = (RewritecWarning, KernelFallback)

pytest.importorskip("expecttest")  # common_methods_invocations imports it
from torch.testing._internal.common_methods_invocations import (  # noqa: E402 - after the skip
    binary_ufuncs,
    reduction_ops,
    unary_ufuncs,
)

FULL = os.environ.get("REWRITEC_OPINFO", "") == "full"
SAMPLES_PER_OP = 3 if FULL else 1
DTYPE = torch.float32
TOLS = {"rtol": 1e-4, "atol": 1e-5}

# Ops whose first sample rewritec gets wrong today, pending a fix: op id -> reason.
# Each is xfail(strict=True): once fixed, the XPASS says to remove the entry.
# (Empty now: the 22 ops that failed when this file was written - 21 scalar
# comparisons lowered to the .Tensor overload, and `chalf`'s dtype - are fixed and
# regression-tested in tests/regressions/.)
KNOWN_FAILURES: dict[str, str] = {}


def _op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _ops() -> list[Any]:
    ops, seen = [], set()
    for op in itertools.chain(unary_ufuncs, binary_ufuncs, reduction_ops):
        if op.name.startswith("_refs") or _op_id(op) in seen:
            continue
        if DTYPE not in op.supported_dtypes("cpu"):
            continue
        seen.add(_op_id(op))
        ops.append(op)
    return ops


OPS = _ops()
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
# Filled by test_opinfo, printed by test_opinfo_summary.
SUMMARY: Counter[str] = Counter()
KERNEL_OPS: Counter[str] = Counter()
FAILURES: list[str] = []
FELL_BACK: list[str] = []
GRAPH_SHARES: list[float] = []  # GraphRecord.to_json()["kernel_op_share"] per graph


def _split(sample: Any) -> tuple[list[torch.Tensor], Any]:
    """The sample's tensors (graph inputs) and a function rebuilding the call."""
    leaves, spec = torch.utils._pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(ts: tuple[torch.Tensor, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        flat = list(leaves)
        for i, t in zip(where, ts, strict=True):
            flat[i] = t
        return torch.utils._pytree.tree_unflatten(flat, spec)

    return tensors, rebuild


def _make_fn(op: Any, rebuild: Any) -> Any:
    def fn(*ts: torch.Tensor) -> Any:
        inp, args, kwargs = rebuild(ts)
        return op.op(inp, *args, **kwargs)

    return fn


def _clones(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in ts]


def _run(fn: Any, tensors: list[torch.Tensor], backend: str) -> tuple[Any, list[str]]:
    """(result, rewritec fallback messages); raises whatever compiling or running raises."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        for w in FALLBACK_WARNINGS:
            warnings.simplefilter("always", w)
        out = compiled(*_clones(tensors))
    return out, [str(w.message) for w in caught if issubclass(w.category, FALLBACK_WARNINGS)]


def _matches(got: Any, want: Any) -> str | None:
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **TOLS)
    except (AssertionError, TypeError, ValueError) as e:
        return str(e)
    return None


def _peer_fails(fn: Any, tensors: list[torch.Tensor], want: Any) -> bool:
    """Does the same capture, with no compiler, fail or disagree with eager too?"""
    try:
        got, _ = _run(fn, tensors, "aot_eager")
    except Exception:  # noqa: BLE001
        return True
    return _matches(got, want) is not None


def _check_sample(op: Any, sample: Any) -> str | None:
    """Run one sample; count it; return a failure description or None."""
    tensors, rebuild = _split(sample)
    fn = _make_fn(op, rebuild)
    try:
        want = fn(*_clones(tensors))
    except Exception:  # noqa: BLE001 - an invalid sample for this dtype
        SUMMARY["samples eager fails"] += 1
        return None
    SUMMARY["samples tried"] += 1
    start = len(report.RECORDS)
    problem = None
    fallbacks: list[str] = []
    try:
        got, fallbacks = _run(fn, tensors, "rewritec")
        mismatch = _matches(got, want)
        if mismatch:
            problem = f"mismatch: {mismatch}"
    except Exception as e:  # noqa: BLE001
        problem = f"{type(e).__name__}: {str(e).strip()[:500]}"
    records = report.RECORDS[start:]
    for r in records:
        KERNEL_OPS["kernel"] += sum(k.get("replaced_ops", 0) for k in r.kernels)
        KERNEL_OPS["aten"] += sum(r.fallback_ops.values())
        GRAPH_SHARES.append(r.to_json()["kernel_op_share"])
    if problem is not None:
        if _peer_fails(fn, tensors, want):
            SUMMARY["samples peer fails too"] += 1
            return None
        SUMMARY["samples failed"] += 1
        return problem
    if fallbacks or any(r.status == "fallback" for r in records):
        SUMMARY["samples fell back"] += 1
        FELL_BACK.append(f"{_op_id(op)}: {(fallbacks or [r.reason for r in records])[0]}")
    elif not records:
        SUMMARY["samples not captured (eager)"] += 1
        FELL_BACK.append(f"{_op_id(op)}: no graph reached the backend (Dynamo ran it)")
    else:
        SUMMARY["samples matched"] += 1
    return None


@pytest.mark.parametrize(
    "op",
    [pytest.param(op, id=_op_id(op), marks=[pytest.mark.xfail(
        strict=True, reason=KNOWN_FAILURES[_op_id(op)])] if _op_id(op) in KNOWN_FAILURES
        else []) for op in OPS])
def test_opinfo(op: Any) -> None:
    torch.manual_seed(0)  # sample inputs are random
    SUMMARY["ops tried"] += 1
    samples = list(itertools.islice(op.sample_inputs("cpu", DTYPE, requires_grad=False),
                                    SAMPLES_PER_OP))
    problems = []
    for i, sample in enumerate(samples):
        problem = _check_sample(op, sample)
        if problem:
            problems.append(f"sample {i}: {problem}")
    if problems:
        SUMMARY["ops failed"] += 1
        known = " (known)" if _op_id(op) in KNOWN_FAILURES else ""
        FAILURES.append(f"{_op_id(op)}{known}: {problems[0].splitlines()[0][:200]}")
    assert not problems, "\n".join(problems)


def test_opinfo_summary() -> None:
    """Print what the OpInfo run did (shows with `pytest -s`)."""
    total = KERNEL_OPS["kernel"] + KERNEL_OPS["aten"]
    share = KERNEL_OPS["kernel"] / total if total else 0.0
    lines = [(f"rewritec OpInfo oracle ({'full' if FULL else 'quick'}: "
              f"{SAMPLES_PER_OP} sample(s) per op, {len(OPS)} ops)")]
    keys = ["ops tried", "ops failed", "samples tried", "samples matched", "samples fell back",
            "samples not captured (eager)", "samples failed", "samples peer fails too",
            "samples eager fails"]
    lines += [f"  {k}: {SUMMARY[k]}" for k in keys]
    lines.append(f"  ops in generated kernels: {KERNEL_OPS['kernel']} of {total} "
                 f"({100 * share:.1f}%)")
    if GRAPH_SHARES:
        lines.append(f"  kernel_op_share per graph: mean {mean(GRAPH_SHARES):.3f} over "
                     f"{len(GRAPH_SHARES)} graphs, "
                     f"{sum(1 for g in GRAPH_SHARES if g > 0)} with a kernel")
    lines += [f"  fell back: {f}" for f in FELL_BACK]
    lines += [f"  failed: {f}" for f in FAILURES]
    print("\n" + "\n".join(lines))
