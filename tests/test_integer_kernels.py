"""Integers and bool masks inside kernels (kinds/kernels.py: INT_OPS; engine/fuse.py:
kernel_value): integer arithmetic in the integer's own dtype (exact past 2**24,
wrapping as ATen's does), casts between integers, bools and floats, constant_pad_nd
(kinds/indexed.py), and masks written out. Against eager on several shapes, strides
and dtypes; what kernels do not compute (integer division, sums of integers, int16)
still runs through ATen. Counts (sums of masks) are computed in f64."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops
from rewritec import report

DEVICE, TARGETS = kernel_targets()
INTS = [torch.int64, torch.int32]
# Triton's interpreter truncates float32 -> bfloat16 where a GPU rounds
# (tests/fuzz_graphs.py: triton-interpreter-truncates-bfloat16)
INTERPRETED = DEVICE == "cpu"


def _run(fn: Callable[..., object], inputs: list[torch.Tensor], target: str,
         exact: bool = True) -> tuple[collections.Counter[str], int]:
    """fn compiled for `target` (strict: a kernel that cannot be built is an error)
    against eager, outputs and the gradients of float inputs that require them; the
    ops left outside kernels and the count of kernels."""
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rewritec",
                             options={"target": target, "strict": True})
    results = []
    for f in (fn, compiled):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        outs = f(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        floats = [o for o in outs if o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        torch.manual_seed(1)
        grads = torch.autograd.grad(floats, wrt, [torch.randn_like(o) for o in floats]) \
            if wrt else ()
        results.append([o.detach() for o in outs] + list(grads))
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if exact:
            assert torch.equal(got, want), (got, want)
        elif got.is_floating_point():
            torch.testing.assert_close(got, want)
        else:  # an integer from a rounded float: one apart at most
            assert (got.double() - want.double()).abs().max() <= 1, (got, want)
    kernels = sum(len(r.kernels) for r in report.RECORDS)
    return outside_ops(), kernels


def _ints(shape: tuple[int, ...], dtype: torch.dtype, big: bool, strided: bool
          ) -> torch.Tensor:
    """Integers of `dtype`; `big`: past 2**24 (a float32 would round them), and
    near the dtype's ends so that products wrap."""
    hi = 2 ** 40 if dtype == torch.int64 else 2 ** 30
    x = torch.randint(-hi if big else -9, hi if big else 9, shape, device=DEVICE, dtype=dtype)
    return x.transpose(0, -1).contiguous().transpose(0, -1) if strided else x


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("shape", [(5, 7), (3, 1, 33)], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_integer_arithmetic_is_exact_in_kernels(target, dtype, shape, strided) -> None:
    """where, add with alpha, sub, mul, neg, abs, maximum, minimum, masked_fill and
    clone on integers: one kernel, equal to eager bit for bit (a float32 computation
    would round these values)."""
    torch.manual_seed(0)
    x, y = _ints(shape, dtype, True, strided), _ints(shape, dtype, True, False)
    m = torch.rand(shape, device=DEVICE) > 0.5

    def fn(x, y, m):
        z = torch.where(m, x, 0) + y * 3 - torch.add(x, y, alpha=2)
        w = torch.maximum(-z, y).abs().masked_fill(~m, 7)
        return z, torch.minimum(w, x).clone() * 5

    outside, kernels = _run(fn, [x, y, m], target)
    assert not outside and kernels >= 1, outside


@pytest.mark.parametrize("target", TARGETS)
def test_casts_between_integers_bools_and_floats(target) -> None:
    """float -> integer truncates toward zero, integer -> float rounds to float32
    first (as ATen does on the way to bf16), bool -> integer is 0 or 1, int64 ->
    int32 wraps."""
    torch.manual_seed(0)
    f = torch.randn(6, 9, device=DEVICE) * 50
    i = torch.randint(-2 ** 40, 2 ** 40, (6, 9), device=DEVICE)

    def fn(f, i):
        t = f.to(torch.int64) + (f > 0).to(torch.int64)
        return (t, (t * 3).to(torch.int32), i.to(torch.int32), i.to(torch.float32) * 0.5)

    def halves(f, i):
        return (i + 1).to(torch.bfloat16), f.to(torch.bfloat16).to(torch.int32) - 1

    outside, _ = _run(fn, [f, i], target)
    assert not outside, outside
    outside, _ = _run(halves, [f, i], target, exact=not (INTERPRETED and target == "triton"))
    assert not outside, outside


@pytest.mark.parametrize("target", TARGETS)
def test_masks_are_written_out_by_the_kernel_that_computes_them(target) -> None:
    """A comparison something else reads too is a side output of its kernel, and a
    mask alone a kernel's result: no ATen comparison left."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 33, device=DEVICE), torch.randn(4, 33, device=DEVICE)

    def fn(x, y):
        keep = (x > 0) & (y < 0.5)
        return torch.where(keep, x * 2, y), keep, ~(x == y)

    outside, kernels = _run(fn, [x, y], target)
    assert not outside and kernels <= 2, outside


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("pad", [(0, 1), (2, 3, 1, 0), (-1, 2), (1, 1, -1, 1)], ids=str)
def test_constant_pad_runs_in_kernels(target, dtype, pad) -> None:
    """constant_pad_nd computed where an element comes from, with the fill value
    outside, crops (negative pads) included; read through a slice and a pointwise op
    as a shifted-labels loss does."""
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 6, device=DEVICE) * 9).to(dtype)

    def fn(x):
        p = torch.nn.functional.pad(x, pad, value=-100)
        return p[..., 1:] * 2, p.clone()

    outside, kernels = _run(fn, [x], target)
    assert not outside and kernels >= 1, outside


@pytest.mark.parametrize("target", TARGETS)
def test_a_pad_value_the_dtype_rounds_stays_with_aten(target) -> None:
    """0.1 is not a bfloat16: ATen rounds the fill value first; no kernel pads with it."""
    x = torch.randn(3, 5, device=DEVICE, dtype=torch.bfloat16)
    outside, _ = _run(lambda x: torch.nn.functional.pad(x, (1, 1), value=0.1) * 2, [x], target)
    assert outside["constant_pad_nd"] == 1, outside


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("ignored", [0, 5], ids=["no_ignored", "ignored"])
def test_shifted_labels_loss_forward_and_backward(target, ignored) -> None:
    """A causal LM's loss as Hugging Face writes it: labels padded with -100,
    shifted, masked; the label work runs in kernels (the pad, saved for the
    backward, is computed once)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 40, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), device=DEVICE)
    labels[0, :ignored] = -100

    def fn(logits, labels):
        labels = torch.nn.functional.pad(labels, (0, 1), value=-100)
        shift = labels[..., 1:].contiguous().view(-1)
        return torch.nn.functional.cross_entropy(logits.view(-1, 40), shift,
                                                 ignore_index=-100)

    outside, _ = _run(fn, [logits, labels], target, exact=False)
    for op in ("where", "ne", "clone"):
        assert op not in outside, outside


@pytest.mark.parametrize("target", TARGETS)
def test_batch_norm_step_counter_runs_in_a_kernel(target) -> None:
    """BatchNorm's num_batches_tracked + 1 (an int64 0-dim buffer): a kernel."""
    bn = torch.nn.BatchNorm1d(4).to(DEVICE).train()
    compiled_bn = torch.nn.BatchNorm1d(4).to(DEVICE).train()
    x = torch.randn(8, 4, device=DEVICE)
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_bn, backend="rewritec",
                             options={"target": target, "strict": True})
    for _ in range(3):
        torch.testing.assert_close(compiled(x), bn(x))
    assert torch.equal(compiled_bn.num_batches_tracked, bn.num_batches_tracked)
    assert compiled_bn.num_batches_tracked.item() == 3
    assert "add" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
def test_what_kernels_do_not_compute_stays_with_aten(target) -> None:
    """Integer division, remainders, sums of integers (not of masks) and int16:
    ATen, right."""
    x = torch.randint(-50, 50, (4, 6), device=DEVICE)
    s = torch.randint(-50, 50, (4, 6), device=DEVICE, dtype=torch.int16)

    def fn(x, s):
        return (x + 1) // 3, (x * 2) % 7, (x - 1).sum(1), s + 1

    outside, _ = _run(fn, [x, s], target)
    for op in ("div", "remainder", "sum"):
        assert sum(v for k, v in outside.items() if k.startswith(op)) >= 1, outside
    assert outside["add"] >= 1, outside  # the int16 one


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dims", [None, 1, (0, 2)], ids=str)
def test_counts_of_masks_are_exact_in_kernels(target, dims) -> None:
    """sum of a bool mask (an int64 count) is a reduction computed in f64, exact;
    with the masked sum beside it (a loss's mean over kept labels) one kernel."""
    torch.manual_seed(0)
    x = torch.randn(6, 50, 7, device=DEVICE)

    def fn(x):
        keep = x > -0.3
        n = keep.sum() if dims is None else keep.sum(dims)
        total = torch.where(keep, x, 0.0).sum() if dims is None else \
            torch.where(keep, x, 0.0).sum(dims)
        return n, total / n.to(torch.float32), n + 1

    outside, kernels = _run(fn, [x], target, exact=False)
    assert not outside, outside


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape,dim,keepdim", [((4, 8), -1, True), ((2, 3, 5, 7), 1, False),
                                               ((3, 5000), -1, True), ((9,), 0, False)], ids=str)
def test_any_along_a_dim_is_a_count_in_a_kernel(target, shape, dim, keepdim) -> None:
    """any(mask, dim) (SDPA's decomposition asks it of every attention row) is a count
    that is not zero (rules/decompose/reductions.yaml), computed in a kernel: rows
    with no true, with one, with all."""
    torch.manual_seed(0)
    x = torch.rand(shape, device=DEVICE)
    x.reshape(-1)[:3] = 2.0  # a few true elements in an otherwise false row
    if x.dim() > 1:
        x.select(dim, 0).fill_(0.5)  # rows with no element above 1.5

    def fn(x):
        return torch.any(x > 1.5, dim=dim, keepdim=keepdim), \
            torch.any(~(x > 1.5), dim=dim, keepdim=keepdim)

    outside, kernels = _run(fn, [x], target)
    assert not outside and kernels >= 1, outside


@pytest.mark.skipif(INTERPRETED and "openmp" not in TARGETS, reason="2**24 elements")
def test_a_count_past_float32_is_exact() -> None:
    """2**24 + 3 kept elements: float32 would give 2**24 + 4."""
    target = "openmp" if "openmp" in TARGETS else "triton"
    m = torch.ones(2 ** 24 + 3, device=DEVICE, dtype=torch.bool)
    outside, _ = _run(lambda m: (m & m).sum(), [m], target)
    assert not outside, outside


@pytest.mark.parametrize("target", [*TARGETS, "aten"])
@pytest.mark.parametrize("classes", [40, 40000], ids=str)
def test_class_positions_are_computed_by_the_row_kernel(target, classes) -> None:
    """The cross entropy's class positions (rewritec::iota, aten/iota.py) come from
    the row kernel's column index, in one pass over the row and in chunks (wide
    rows); through ATen (target aten) the op's own arange gives them."""
    torch.manual_seed(0)
    logits = torch.randn(5, classes, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, classes, (5,), device=DEVICE)
    labels[1] = -100

    def fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)

    outside, _ = _run(fn, [logits, labels], target, exact=False)
    if target == "aten":
        assert outside["rewritec::iota"] >= 1, outside
    else:
        assert not any("iota" in k or "arange" in k for k in outside), outside
