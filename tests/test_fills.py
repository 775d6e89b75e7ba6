"""Fills and positions: a small `full` or `arange` is folded with what reads it at
compile time (aten/fold.py: SOURCES); a larger fill, and `full_like`, a kernel
computes inline as a literal of their dtype (kinds/kernels.py: value_expr). Views of
a fill are fills (the *-of-full rules, rules/simplify/views.yaml), and a copy onto a
fill is the copied value (copy-onto-fill). Against eager, forward and backward, on
every kernel target, both ways (`fills`: folded, or inline with no fill folded); a
fill alone, or one its dtype cannot hold exactly, stays ATen's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops, rules_fired
from rewritec import report
from rewritec.aten import fold

DEVICE, TARGETS = kernel_targets()
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["folded", "inline"])
def fills(request, monkeypatch) -> str:
    if request.param == "inline":
        monkeypatch.setattr(fold, "MAX_SOURCE_NUMEL", 0)
    return request.param


def _run(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, target: str) -> None:
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="rewritec", options={"target": target, "strict": True})
    results = []
    for f in (fn, compiled):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = f(*xs)
        wrt = [x for x in xs if x.requires_grad]
        grads = torch.autograd.grad(out, wrt, torch.ones_like(out)) if out.requires_grad \
            else ()
        results.append([out.detach(), *grads])
    tol = {} if inputs[0].dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("batch,t", [(2, 16), (3, 33)])
def test_an_attention_mask_made_from_ones_is_computed_in_its_kernel(target, dtype, batch, t,
                                                                   fills) -> None:
    """A default attention mask (ones), turned into an additive one and reshaped,
    as Hugging Face's encoders do when no mask is given: a constant, folded. Not
    folded, the fill and the ops on it, which broadcast to the softmax's rows, are
    computed in the softmax's row kernel."""
    def scores(x):
        ones = torch.full((x.shape[0], t), 1, dtype=torch.int64, device=x.device)
        extended = (1.0 - ones[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        return torch.softmax(x + extended, dim=-1)

    x = torch.randn(batch, 4, t, t, device=DEVICE).to(dtype)
    _run(scores, x, target=target)
    if target == "openmp" and dtype == torch.float16:
        return  # f16 stays with ATen on the CPU
    if fills == "folded":
        assert "full" not in outside_ops() and rules_fired()["fold-constants"], outside_ops()
    else:
        assert not outside_ops() and rules_fired()["unsqueeze-of-full"], outside_ops()
        assert len(report.RECORDS[0].kernels) == 1  # the forward: the row kernel


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_fill_larger_than_every_input_sizes_the_kernel(target, dtype, fills) -> None:
    """The kernel's space comes from the fill where no input has its sizes."""
    def widen(x):
        return x[None, :] * 2.0 + torch.full((5, 1, x.shape[-1]), 0.5, dtype=x.dtype,
                                             device=x.device)

    _run(widen, torch.randn(3, 8, device=DEVICE).to(dtype), target=target)
    if not (target == "openmp" and dtype == torch.float16):  # f16: ATen's on the CPU
        assert "full" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 5)], ids=str)
def test_fills_of_every_dtype_and_their_views(target, shape, fills) -> None:
    """Bool, integer and float fills, through a transpose, a slice and a select; a
    mask's fill of -inf."""
    def mixed(x):
        keep = torch.full(shape, True, device=x.device) & (x > 0)
        count = torch.full(shape, 3, dtype=torch.int64, device=x.device).transpose(0, -1)
        lows = torch.full((shape[0] + 2, *shape[1:]), float("-inf"), device=x.device)[1:-1]
        y = torch.where(keep, x, lows) + count.transpose(0, -1).to(x.dtype)
        return y.clamp(min=-5.0) * torch.full((2, *shape), 0.25, device=x.device).select(0, 1)

    _run(mixed, torch.randn(shape, device=DEVICE), target=target)
    assert "full" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
def test_a_copy_onto_a_fill_is_the_copied_value(target, fills) -> None:
    """T5's shifted labels: the labels but the last, from position 1, onto zeros."""
    def shift(labels, x):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        return x * shifted.to(x.dtype)

    labels = torch.randint(0, 50, (3, 9), device=DEVICE)
    _run(shift, labels, torch.randn(3, 9, device=DEVICE), target=target)
    assert "copy" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_fill_its_dtype_rounds_stays_aten(target, dtype, fills) -> None:
    """0.1 is no bf16 or f16 number: ATen rounds it when it fills; a literal in a
    float32 computation would not, so the fill stays outside (or is folded, by ATen)
    and the result is eager's."""
    def scaled(x):
        return x * torch.full(x.shape, 0.1, dtype=x.dtype, device=x.device) + 1.0

    _run(scaled, torch.randn(4, 8, device=DEVICE).to(dtype), target=target)
    assert bool(outside_ops()["full"]) == (fills == "inline"), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
def test_a_fill_alone_stays_aten(target, monkeypatch) -> None:
    monkeypatch.setattr(fold, "MAX_SOURCE_NUMEL", 0)

    def alone(x):
        return x @ torch.full((x.shape[-1], 3), 2.0, device=x.device)

    _run(alone, torch.randn(4, 8, device=DEVICE), target=target)
    assert outside_ops()["full"] and not any(r.kernels for r in report.RECORDS), outside_ops()



@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("t", [8, 33])
def test_a_mask_built_from_positions_is_folded(target, t) -> None:
    """A causal mask from `arange` positions (compared, summed, indexed, as Hugging
    Face's decoders build theirs) is a constant: folded, nothing of it left to run."""
    def causal(x):
        pos = torch.arange(t, device=x.device)
        packed = torch.cumsum((pos[None, :].expand(x.shape[0], -1) == 0).long(), -1)
        seq = packed[torch.arange(x.shape[0], device=x.device)[:, None], pos]
        keep = (pos[None, :] <= pos[:, None])[None] & (seq[:, None, :] == seq[:, :, None])
        return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)

    _run(causal, torch.randn(3, t, t, device=DEVICE), target=target)
    assert not {"arange", "cumsum", "index"} & set(outside_ops()), outside_ops()
    assert rules_fired()["fold-constants"], rules_fired()


@pytest.mark.parametrize("target", TARGETS)
def test_positions_past_the_fold_limit_stay_an_op(target) -> None:
    def offsets(x):
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)

    _run(offsets, torch.randn(2, fold.MAX_SOURCE_NUMEL + 5, device=DEVICE), target=target)
    assert outside_ops()["arange"] == 1, outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("value", [-0.0, float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_fills_of_signed_zeros_and_non_finite_values(target, value, dtype, monkeypatch) -> None:
    """A literal keeps a fill's sign of zero, its nan and its infinities."""
    monkeypatch.setattr(fold, "MAX_SOURCE_NUMEL", 0)

    def pick(x):
        return torch.where(x > 100.0, x, torch.full(x.shape, value, dtype=x.dtype,
                                                     device=x.device))

    x = torch.randn(4, 8, device=DEVICE).to(dtype)
    report.reset()
    torch._dynamo.reset()
    got = torch.compile(pick, backend="rewritec", options={"target": target})(x)
    want = pick(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    if not (target == "openmp" and dtype == torch.float16):  # f16: ATen's on the CPU
        assert "full" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64, torch.int32, torch.int64], ids=str)
def test_negation_flips_the_sign_of_zero(target, dtype) -> None:
    """neg(+0.0) is -0.0 and neg(-0.0) is +0.0 in kernels, as in eager (rules/ops.yaml:
    Triton's unary minus subtracts from +0.0); integers negate as integers."""
    if dtype.is_floating_point:
        x = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf"), float("nan")] * 4,
                         device=DEVICE, dtype=dtype)
    else:
        x = torch.tensor([0, 1, -7, 2**20, -(2**20), 3] * 4, device=DEVICE, dtype=dtype)

    def flip(x):
        return torch.neg(x) * 3 + torch.neg(x * 0)

    torch._dynamo.reset()
    report.reset()
    got = torch.compile(flip, backend="rewritec", options={"target": target})(x)
    want = flip(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    if dtype.is_floating_point:  # a NaN's sign bit is no value's
        numbers = ~torch.isnan(want)
        assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers]))
    if not (target == "openmp" and dtype == torch.float16):
        assert "neg" not in outside_ops(), outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [*FLOATS, torch.int64], ids=str)
def test_zero_dim_tensors_of_one_value_are_fills_in_kernels(target, dtype) -> None:
    """`where(m, 0-d 0.0, 0-d -inf)` in a half dtype, as an attention mask's bias is
    built: the numbers alone would compute in f32, so they stay 0-d tensors, which
    rules/decompose/fills.yaml writes as fills that the kernel computes inline; no
    `scalar_tensor` launch is left."""
    low = float("-inf") if dtype.is_floating_point else -(2**40)

    def bias(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        zero = torch.ops.aten.scalar_tensor(0, dtype=dtype, device=x.device)
        floor = torch.ops.aten.scalar_tensor(low, dtype=dtype, device=x.device)
        return torch.where(m, zero, floor) + x

    m = torch.rand(3, 8, device=DEVICE) > 0.5
    x = (torch.randn(3, 8, device=DEVICE) * 4).to(dtype)
    torch._dynamo.reset()
    report.reset()
    got = torch.compile(bias, backend="rewritec", options={"target": target})(m, x)
    want = bias(m, x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    if dtype in (torch.bfloat16, torch.float16):  # f32, i64: read as numbers already
        assert "scalar-tensor-as-full" in rules_fired()
    if not (target == "openmp" and dtype == torch.float16):  # f16: ATen's on the CPU
        assert "scalar_tensor" not in outside_ops() and "where" not in outside_ops(), \
            outside_ops()
