"""Kernels over mixed dtypes and bool masks (kinds/kernels.py: can_compile):
a half value plus an f32 one (a residual add under autocast) and comparisons
that a `where` reads join the kernel around them, and results equal eager's.

Half-precision kernels compute in f32 and round once, where eager rounds after
every op: their results are compared with eager run in f32, then rounded."""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec import report

HALF = [torch.bfloat16, torch.float16]
# (target, dtype): the OpenMP target computes f32 and f64 only
CASES = [("triton", torch.float32), ("triton", torch.bfloat16), ("triton", torch.float16),
         ("openmp", torch.float32), ("openmp", torch.float64)]


def residual(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return torch.relu(x + r) * 2.0 + r  # x half, r f32: f32 result


def masked(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    m = (x > 0.5) & (y <= 0.25)
    return torch.where(m, x * y, -x) + (x < 0).to(x.dtype) * 2.0 + torch.where(~m, y, 1.0)


def clamp_like(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    keep = torch.logical_and(x >= -0.5, torch.logical_not(x > 0.5))
    return torch.where(keep, x, 0.0) * y


def _device(target: str) -> str:
    """Triton kernels run on the GPU where there is one, else on the CPU through
    Triton's interpreter (tests/conftest.py); OpenMP kernels on the CPU."""
    return "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"


def _run(fn, target: str, dtype: torch.dtype, *inputs: torch.Tensor, grad: bool = False):
    inputs = tuple(x.to(_device(target)) for x in inputs)
    report.reset()
    torch._dynamo.reset()
    compiled = rewritec.compile(fn, target=target, strict=True)
    leaves = [x.detach().clone().requires_grad_(grad and x.is_floating_point())
              for x in inputs]
    got = compiled(*leaves)
    # the reference: eager in f32 (f64 stays f64), rounded as the kernel rounds
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    ref_in = [x.detach().to(wide).requires_grad_(grad) for x in inputs]
    want = fn(*ref_in)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype in HALF else {}
    torch.testing.assert_close(got, want.to(got.dtype), **tol)
    if grad:
        cot = torch.randn_like(want)
        got.backward(cot.to(got.dtype))
        want.backward(cot)
        for a, b in zip(leaves, ref_in, strict=True):
            torch.testing.assert_close(a.grad, b.grad.to(a.grad.dtype), **tol)
    return report.RECORDS


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(8, 33), (3, 5, 64), (1000,)])
def test_a_half_plus_an_f32_is_one_kernel(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, r = torch.randn(shape).to(dtype), torch.randn(shape)
    with torch.no_grad():
        (rec,) = _run(residual, "triton", dtype, x, r)
    assert len(rec.kernels) == 1 and not rec.fallback_ops, rec.fallback_ops


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_plus_an_f32_backward(dtype: torch.dtype) -> None:
    _run(residual, "triton", dtype, torch.randn(6, 40).to(dtype), torch.randn(6, 40),
         grad=True)


@pytest.mark.parametrize("target,dtype", CASES)
@pytest.mark.parametrize("fn", [masked, clamp_like], ids=lambda f: f.__name__)
def test_bool_masks_stay_inside_the_kernel(target: str, dtype: torch.dtype, fn) -> None:
    x, y = torch.randn(7, 33).to(dtype), torch.randn(33).to(dtype)
    with torch.no_grad():
        (rec,) = _run(fn, target, dtype, x, y)
    assert len(rec.kernels) == 1, rec.kernels
    outside = set(rec.fallback_ops) & {"gt", "lt", "le", "ge", "bitwise_and", "bitwise_not",
                                       "logical_and", "logical_not", "where", "_to_copy"}
    assert not outside, rec.fallback_ops


@pytest.mark.parametrize("target,dtype", CASES)
def test_bool_masks_forward_and_backward(target: str, dtype: torch.dtype) -> None:
    base = torch.randn(5, 2, 33).to(dtype)
    _run(masked, target, dtype, base.transpose(0, 1), torch.randn(33).to(dtype), grad=True)


@pytest.mark.parametrize("dtype", HALF)
def test_a_number_the_half_dtype_rounds_is_compared_as_eager_does(dtype: torch.dtype) -> None:
    """0.1 is not a bf16 or f16 number: ATen compares with it rounded, so that
    comparison stays with ATen; 0.5 is, and joins the kernel."""
    x = torch.tensor([0.1, 0.0999, 0.1001, 0.5, -1.0]).to(dtype).repeat(20)
    x = x.to(_device("triton"))

    def near(x):
        return torch.where(x > 0.1, x, 0.0) + torch.where(x < 0.5, 1.0, x)

    report.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        got = rewritec.compile(near, target="triton", strict=True)(x)
    torch.testing.assert_close(got, near(x), rtol=0, atol=0)
    (rec,) = report.RECORDS
    assert rec.fallback_ops.get("gt") == 1 and "lt" not in rec.fallback_ops


@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("target,dtype", [("triton", torch.bfloat16), ("triton", torch.float32),
                                          ("openmp", torch.float32)])
def test_rms_norm_is_one_kernel(eps: float | None, target: str, dtype: torch.dtype) -> None:
    """nn.RMSNorm (eps=None: the dtype's epsilon, an `add.Scalar` in the graph), its
    casts to f32 and back included, on the torch.compile and torch.export paths."""
    from rewritec.frontend.export import ExportedProgram
    from rewritec.options import Options

    m = torch.nn.RMSNorm(64, eps=eps).to(dtype)
    torch.nn.init.normal_(m.weight)
    x = torch.randn(4, 9, 64).to(dtype)
    m, x = m.to(_device(target)), x.to(_device(target))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype in HALF else {}
    with torch.no_grad():
        want = m(x)
        report.reset()
        torch._dynamo.reset()
        torch.testing.assert_close(rewritec.compile(m, target=target, strict=True)(x), want,
                                   **tol)
        report.RECORDS.clear()
        ep = ExportedProgram(m, (x,), Options.make(target=target, strict=True))
        torch.testing.assert_close(ep(x), want, **tol)
    (traced,) = report.RECORDS
    assert len(traced.kernels) == 1 and not traced.fallback_ops, traced.fallback_ops


def _lm_loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A language-model head under autocast: bf16 logits, an f32 cross entropy over
    rows of the flattened batch (the backward views the gradient, then casts it)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(x, w)
    vocab = w.shape[0]
    return torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), y.view(-1))


@pytest.mark.parametrize("vocab", [37, 130])
@pytest.mark.parametrize("shape", [(2, 8), (3, 5)])
def test_autocast_gradient_cast_joins_the_kernel_that_computes_it(vocab: int,
                                                                  shape: tuple) -> None:
    """The cross entropy's gradient is viewed, then cast to bf16: rule
    cast-through-view moves the cast next to the row kernel that computes the
    gradient, which then writes bf16 itself (no f32 copy, no cast kernel), and
    autocast's spelled-out casts (strided layout, the source's device) are plain
    `to(x, dtype=d)` for the rules (aten/convert.py: _plain_cast)."""
    device = _device("triton")
    torch.manual_seed(0)
    x = torch.randn(*shape, 16, device=device, requires_grad=True)
    w = torch.randn(vocab, 16, device=device, requires_grad=True)
    y = torch.randint(0, vocab, shape, device=device)
    report.reset()
    torch._dynamo.reset()
    compiled = rewritec.compile(_lm_loss, target="triton", strict=True)
    loss = compiled(x, w, y)
    loss.backward()
    got = (loss.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    loss_e = _lm_loss(x, w, y)
    loss_e.backward()
    for g, e in zip(got, (loss_e.detach(), x.grad, w.grad), strict=True):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)
    backward = next(r for r in report.RECORDS if r.kind == "backward")
    assert backward.rules_fired["cast-through-view"] >= 1
    rows = [k for k in backward.kernels if k["rules"] == ["fuse-row"]]
    assert rows and any("to" in k["ops"] for k in rows), backward.kernels
    assert "_to_copy" not in backward.fallback_ops


SUM_DTYPE_CASES = [
    # (function, input dtype, fused): a `dtype` at least as wide as the input's
    (lambda g: torch.sum(g, 0, keepdim=True, dtype=torch.float32), torch.bfloat16, True),
    (lambda g: torch.sum(g * 2.0, -1, keepdim=True, dtype=torch.float32), torch.float16, True),
    (lambda g: torch.sum(torch.tanh(g), (0, 2), dtype=torch.float32), torch.float32, True),
    (lambda g: torch.mean(g, (0, 1), dtype=torch.float64), torch.float32, True),
    # narrower: ATen rounds every value to it first; an integer dtype counts
    (lambda g: torch.sum(g, 0, dtype=torch.bfloat16), torch.float32, False),
    (lambda g: torch.sum(g > 0, -1, dtype=torch.int64), torch.float32, False),
]


@pytest.mark.parametrize("case", range(len(SUM_DTYPE_CASES)))
@pytest.mark.parametrize("target", ["triton", "openmp"])
@pytest.mark.parametrize("shape", [(67, 33), (5, 9, 130)])
def test_sums_with_a_wider_dtype_join_kernels(case: int, target: str, shape: tuple) -> None:
    """`sum(x, dtype=d)` (autocast's bias gradients on CUDA: bf16 values, an f32 sum)
    is a kernel when `d` widens x's dtype, computed as ATen computes it; a narrower
    or integer `d` stays with ATen (engine/fuse.py: plain_accumulation)."""
    fn, dtype, fused = SUM_DTYPE_CASES[case]
    if target == "openmp" and dtype in HALF:
        pytest.skip("the OpenMP target computes f32 and f64 only")
    if len(shape) == 2 and case == 2:
        shape = (4, 67, 33)
    torch.manual_seed(case)
    g = (torch.randn(*shape) * 10).to(dtype).to(_device(target))
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(g)
    want = fn(g)
    assert got.dtype == want.dtype
    tol = {"rtol": 1e-2, "atol": 1e-2} if want.dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)
    reductions = [k for r in report.RECORDS for k in r.kernels
                  if any(rule.startswith(("fuse-reduction", "fuse-row")) for rule in k["rules"])]
    assert bool(reductions) == fused, [k["rules"] for r in report.RECORDS for k in r.kernels]
