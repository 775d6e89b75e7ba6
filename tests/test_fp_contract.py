"""Generated kernels round as ATen does: no multiply-add contraction into an FMA
(C++ -ffp-contract=off, Triton enable_fp_fusion=False) unless `fast_math`."""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec.runtime import build
from rewritec.runtime.launch import Launcher


def mul_add(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return x * y + z


def add_double(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b + 2 * a


needs_cxx = pytest.mark.skipif(build.cxx() is None, reason="no C++ compiler")


@needs_cxx
def test_mul_add_is_bitwise_eager_on_openmp() -> None:
    x, y, z = (torch.randn(10**6) for _ in range(3))
    got = rewritec.compile(mul_add, target="openmp")(x, y, z)
    assert torch.equal(got, mul_add(x, y, z))


@needs_cxx
def test_overflow_of_product_is_kept_on_openmp() -> None:
    a, b = torch.full((64,), -3e38), torch.full((64,), 3e38)
    got = rewritec.compile(add_double, target="openmp")(a, b)
    assert torch.equal(got, add_double(a, b))  # -inf: 2*a overflows before the add


@needs_cxx
def test_fast_math_may_contract() -> None:
    assert "-ffp-contract=off" in build.cxx_flags(False)
    assert "-ffp-contract=fast" in build.cxx_flags(True)


def _launchers(monkeypatch, fn, args, **options) -> list[Launcher]:
    """The launchers a compilation of `fn` builds."""
    from rewritec import compiler

    seen: list[Launcher] = []
    real = compiler.prepare_kernels

    def spy(*a, **k):
        out = real(*a, **k)
        seen.extend(out.launchers.values())
        return out

    # the compiler's own name for it: it imports the function, not the module
    monkeypatch.setattr(compiler, "prepare_kernels", spy)
    rewritec.compile(fn, **options)(*args)
    return seen


@pytest.mark.parametrize("fast_math", [False, True])
def test_triton_launches_say_whether_to_fuse(monkeypatch, fast_math: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y, z = (torch.randn(1000, device=device) for _ in range(3))
    [launcher] = _launchers(monkeypatch, mul_add, (x, y, z), target="triton",
                            fast_math=fast_math)
    assert launcher.kernel.options == {"enable_fp_fusion": fast_math}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mul_add_is_bitwise_eager_on_triton_gpu() -> None:
    x, y, z = (torch.randn(10**6, device="cuda") for _ in range(3))
    got = rewritec.compile(mul_add, target="triton")(x, y, z)
    assert torch.equal(got, mul_add(x, y, z))
    a, b = torch.full((64,), -3e38, device="cuda"), torch.full((64,), 3e38, device="cuda")
    assert torch.equal(rewritec.compile(add_double, target="triton")(a, b), add_double(a, b))


# Not contraction: the two-pass variance overflows to inf, rsqrt gives 0 and every
# output is (x - mean) * 0 = 0. ATen's Welford moments (moments_utils.h) overflow
# along the way and give nan here, but 0 on other rows whose variance overflows
# ([2e19, -2e19, 0, 0]) and nan on a constant row of 2e19, depending on the row's
# length against the vector width: no formula of the two-pass kind follows it.
@pytest.mark.parametrize("target", ["openmp", "triton"])
def test_layer_norm_near_overflow(target: str) -> None:
    """A row whose variance overflows the dtype is nan, as eager's is, never a silent 0
    (rules/decompose/norms.yaml: layer-norm); the other rows are untouched."""
    if target == "openmp" and build.cxx() is None:
        pytest.skip("no C++ compiler")
    device = "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5],
                      [3e19, -3e19, 0.0, 1.0]], device=device)
    w = torch.randn(4, device=device)

    def ln(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (4,)) + torch.nn.functional.layer_norm(x, (4,), w)

    got = rewritec.compile(ln, target=target, strict=True)(x)
    torch.testing.assert_close(got[:3], ln(x)[:3], equal_nan=True)
    # eager gives 0 here: its Welford steps stay finite although the variance does not
    # (README, Reliability); an overflowing variance is nan in rewritec, on every row
    assert got[0].isnan().all() and got[3].isnan().all()
