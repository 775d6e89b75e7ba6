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
from rewritec.compiler import RewritecWarning
from rewritec.runtime.launch import KernelFallback

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
# The other dtypes, forward: the full run tries each on every op; CI tries one per
# op, turn about, so that every dtype meets a sixth of the ops each run.
OTHER_DTYPES = (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                torch.bool)
TOLERANCES = {torch.float32: {"rtol": 1e-4, "atol": 1e-5},
              torch.float64: {"rtol": 1e-7, "atol": 1e-7},
              torch.float16: {"rtol": 1e-3, "atol": 1e-3},
              torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}
EXACT = {"rtol": 0.0, "atol": 0.0}
TOLS = TOLERANCES[DTYPE]
# f32 gradients: every op in the full run, every third in CI.
GRAD_EVERY = 1 if FULL else 3

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


def _matches(got: Any, want: Any, tols: dict[str, float] = TOLS) -> str | None:
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **tols)
    except (AssertionError, TypeError, ValueError) as e:
        return str(e)
    return None


def _tols(want: Any) -> dict[str, float]:
    leaves = [x for x in torch.utils._pytree.tree_leaves(want) if isinstance(x, torch.Tensor)]
    dtypes = {x.dtype for x in leaves}
    if any(not d.is_floating_point and not d.is_complex for d in dtypes):
        return EXACT
    return max((TOLERANCES.get(d, TOLS) for d in dtypes), key=lambda t: t["rtol"],
               default=TOLS)


def _peer_fails(fn: Any, tensors: list[torch.Tensor], want: Any) -> bool:
    """Does the same capture, with no compiler, fail or disagree with eager too?"""
    try:
        got, _ = _run(fn, tensors, "aot_eager")
    except Exception:  # noqa: BLE001
        return True
    return _matches(got, want, _tols(want)) is not None


def _with_grads(fn: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """`fn` turned into (outputs, gradients of the float inputs) under a fixed random
    output gradient: what a backward graph computes."""
    wants = [i for i, t in enumerate(tensors) if t.is_floating_point()]

    def grads(*ts: torch.Tensor) -> Any:
        ts = tuple(t.detach().requires_grad_(i in wants) for i, t in enumerate(ts))
        out = fn(*ts)
        leaves = [o for o in torch.utils._pytree.tree_leaves(out)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
        gen = torch.Generator().manual_seed(1)
        total = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
                    for o in leaves)
        inputs = [ts[i] for i in wants]
        got = torch.autograd.grad(total, inputs, allow_unused=True) if leaves else ()
        return out, [g if g is not None else torch.zeros_like(x)
                     for g, x in zip(got, inputs, strict=False)]

    return grads, wants


def _check_sample(op: Any, sample: Any, grad: bool = False) -> str | None:
    """Run one sample (with `grad`, its f32 gradients too); count it; return a failure
    description or None."""
    tensors, rebuild = _split(sample)
    fn = _make_fn(op, rebuild)
    if grad:
        fn, wants = _with_grads(fn, tensors)
        if not wants:
            return None
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
        mismatch = _matches(got, want, _tols(want))
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


def _dtype_cases() -> list[Any]:
    cases = []
    for i, op in enumerate(OPS):
        supported = op.supported_dtypes("cpu")
        turn = [OTHER_DTYPES[(i + k) % len(OTHER_DTYPES)] for k in range(len(OTHER_DTYPES))]
        chosen = [d for d in turn if d in supported][: None if FULL else 1]
        cases += [pytest.param(op, d, id=f"{_op_id(op)}-{str(d).removeprefix('torch.')}",
                               marks=_known(f"{_op_id(op)}-{d}")) for d in chosen]
    return cases


def _known(key: str) -> list[Any]:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key])] \
        if key in KNOWN_FAILURES else []


@pytest.mark.parametrize("op,dtype", _dtype_cases())
def test_opinfo_dtype(op: Any, dtype: torch.dtype) -> None:
    """The op's samples at another dtype, forward: f16, bf16, f64, int32, int64, bool."""
    torch.manual_seed(0)
    SUMMARY[f"ops tried at {dtype}"] += 1
    samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=False),
                                    SAMPLES_PER_OP))
    problems = [f"sample {i}: {p}" for i, s in enumerate(samples)
                if (p := _check_sample(op, s)) is not None]
    if problems:
        FAILURES.append(f"{_op_id(op)} at {dtype}: {problems[0].splitlines()[0][:200]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "op", [pytest.param(op, id=_op_id(op), marks=_known(f"{_op_id(op)}-grad"))
           for op in OPS[::GRAD_EVERY] if op.supports_autograd])
def test_opinfo_gradients(op: Any) -> None:
    """The op's f32 samples, forward and backward (AOTAutograd's backward graph)."""
    torch.manual_seed(0)
    SUMMARY["ops tried with gradients"] += 1
    samples = list(itertools.islice(op.sample_inputs("cpu", DTYPE, requires_grad=False),
                                    SAMPLES_PER_OP))
    problems = [f"sample {i}: {p}" for i, s in enumerate(samples)
                if (p := _check_sample(op, s, grad=True)) is not None]
    if problems:
        FAILURES.append(f"{_op_id(op)} gradients: {problems[0].splitlines()[0][:200]}")
    assert not problems, "\n".join(problems)


def test_opinfo_summary() -> None:
    """Print what the OpInfo run did (shows with `pytest -s`)."""
    total = KERNEL_OPS["kernel"] + KERNEL_OPS["aten"]
    share = KERNEL_OPS["kernel"] / total if total else 0.0
    lines = [(f"rewritec OpInfo oracle ({'full' if FULL else 'quick'}: "
              f"{SAMPLES_PER_OP} sample(s) per op, {len(OPS)} ops)")]
    keys = ["ops tried", "ops failed", *sorted(k for k in SUMMARY if k.startswith("ops tried ")),
            "samples tried", "samples matched", "samples fell back",
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
