"""runtime/triton_direct.py: a kernel is launched through its compiled binary only
for a call the JIT would have compiled the same way.

The bookkeeping is checked on the CPU against a stand-in for Triton's JIT (which
records whether a call went through it or straight to the compiled kernel); a
real kernel is checked against eager on misaligned views and other sizes, on the
GPU through the direct path, under the interpreter through the JIT.
"""

from __future__ import annotations

import weakref

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from rewritec.runtime import triton_direct
from rewritec.runtime.triton_direct import DirectKernel


class FakeCompiled:
    function = object()

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args: self.log.append(("direct", grid, args))


class FakeJit:
    """Records each call; returns what Triton's JIT returns (the compiled kernel)."""

    def __init__(self, log: list[Any], compiled: Any = "compiled") -> None:
        self.log = log
        self.compiled = FakeCompiled(log) if compiled == "compiled" else compiled

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled

        return run


PARAMS = [("x", False), ("out", False), ("n", False), ("BLOCK", True)]


def _kernel(params=PARAMS, compiled: Any = "compiled") -> tuple[DirectKernel, list[Any]]:
    log: list[Any] = []
    return DirectKernel(FakeJit(log, compiled), params, device=lambda: 0), log


def _routes(log: list[Any]) -> list[str]:
    return [entry[0] for entry in log]


def test_second_identical_call_skips_the_jit_and_passes_constexprs_last() -> None:
    k, log = _kernel()
    x, out = torch.zeros(64), torch.zeros(64)
    k[(4,)](x, out, 64, BLOCK=16)
    k[(4,)](x, out, 64, BLOCK=16)
    assert _routes(log) == ["jit", "direct"]
    assert log[1] == ("direct", (4, 1, 1), (x, out, 64, 16))  # the grid as the launcher reads it
    assert k.direct == 1


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int", "constexpr", "grid",
                                    "num_warps"])
def test_a_call_specialized_differently_goes_through_the_jit(change: str) -> None:
    k, log = _kernel()
    buf = torch.zeros(80)
    x, out = buf[:64], torch.zeros(64)
    k[(4,)](x, out, 64, BLOCK=16, num_warps=4)
    args: list[Any] = [x, out, 64]
    grid, kwargs = (4,), {"BLOCK": 16, "num_warps": 4}
    if change == "misaligned":
        args[0] = buf[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change == "int":
        args[2] = 63
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "grid":
        grid = (5,)
    else:
        kwargs["num_warps"] = 8
    k[grid](*args, **kwargs)
    k[grid](*args, **kwargs)
    assert _routes(log) == ["jit", "jit", "direct"]


def test_a_constexpr_passed_positionally_is_part_of_the_signature() -> None:
    """Row kernels take `n_cols: tl.constexpr` before the run-time sizes."""
    k, log = _kernel([("x", False), ("n_cols", True), ("n", False), ("BLOCK", True)])
    x = torch.zeros(64)
    for n_cols in (64, 64, 32, 32):
        k[(2,)](x, n_cols, 7, BLOCK=16)
    assert _routes(log) == ["jit", "direct", "jit", "direct"]
    assert log[1] == ("direct", (2, 1, 1), (x, 64, 7, 16))
    assert log[3] == ("direct", (2, 1, 1), (x, 32, 7, 16))


def test_one_true_and_one_point_zero_are_different_signatures() -> None:
    k, log = _kernel()
    x, out = torch.zeros(8), torch.zeros(8)
    for n in (1, True, 1.0, 1, True, 1.0):
        k[(1,)](x, out, n, BLOCK=8)
    assert _routes(log) == ["jit"] * 3 + ["direct"] * 3
    assert [entry[2][2] for entry in log[3:]] == [1, True, 1.0]
    assert [type(entry[2][2]) for entry in log[3:]] == [int, bool, float]


def test_another_device_goes_through_the_jit() -> None:
    log: list[Any] = []
    device = [0]
    k = DirectKernel(FakeJit(log), PARAMS, device=lambda: device[0])
    x, out = torch.zeros(8), torch.zeros(8)
    k[(1,)](x, out, 8, BLOCK=8)
    device[0] = 1
    k[(1,)](x, out, 8, BLOCK=8)
    assert _routes(log) == ["jit", "jit"]


def test_calls_that_cannot_be_replayed_always_go_through_the_jit() -> None:
    x, out = torch.zeros(8), torch.zeros(8)
    cases = {
        # a run-time parameter passed by name: the launcher takes it by position
        "interleaved": (_kernel([("x", False), ("BLOCK", True), ("out", False), ("n", False)]),
                        lambda k: k[(1,)](x, out, 8, BLOCK=8)),
        # the interpreter returns no compiled kernel
        "interpreted": (_kernel(compiled=None), lambda k: k[(1,)](x, out, 8, BLOCK=8)),
        # a constexpr left to its default
        "default": (_kernel(), lambda k: k[(1,)](x, out, 8)),
        # an unhashable argument
        "unhashable": (_kernel(), lambda k: k[(1,)](x, out, [8], BLOCK=8)),
        # a grid given as a list
        "list grid": (_kernel(), lambda k: k[[1]](x, out, 8, BLOCK=8)),
    }
    for name, ((k, log), call) in cases.items():
        call(k)
        call(k)
        assert _routes(log) == ["jit", "jit"], name
    k = DirectKernel(FakeJit([]), None, device=lambda: 0)  # not a compiled-mode JITFunction
    assert k.params is None


def test_a_launcher_that_fails_hands_every_later_call_to_the_jit() -> None:
    class Broken(FakeCompiled):
        def __getitem__(self, grid: Any) -> Any:
            def run(*args: Any) -> None:
                raise IndexError("tuple index out of range")

            return run

    log: list[Any] = []
    k = DirectKernel(FakeJit(log, Broken(log)), PARAMS, device=lambda: 0)
    x, out = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        k[(1,)](x, out, 8, BLOCK=8)
    assert _routes(log) == ["jit", "jit", "jit"] and k.disabled and k.direct == 0


def test_signatures_beyond_the_limit_are_not_remembered(monkeypatch) -> None:
    monkeypatch.setattr(triton_direct, "LIMIT", 2)
    k, log = _kernel()
    x, out = torch.zeros(8), torch.zeros(8)
    for n in (1, 2, 3, 1, 2, 3):
        k[(1,)](x, out, n, BLOCK=8)
    assert _routes(log) == ["jit", "jit", "jit", "direct", "direct", "jit"]


@triton.jit
def _add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)


def test_real_kernel_matches_eager_across_alignment_and_sizes() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k = DirectKernel(_add_one)  # under the interpreter: no params, every call through the JIT
    buf = torch.randn(4099, device=device)
    for view in (buf[:4096], buf[:4096], buf[1:4097], buf[1:4097], buf[3:4098], buf[:1000],
                 buf[:4096]):
        out = torch.empty_like(view)
        n = view.numel()
        k[(triton.cdiv(n, 1024),)](view, out, n, BLOCK=1024)
        torch.testing.assert_close(out, view + 1)
    if device == "cuda":
        # repeats of the aligned view, the misaligned one and the last call
        assert k.direct == 3


class _Compiled:
    """Stands in for a CompiledKernel around an interpreted kernel: its runner takes
    every argument positionally, constexprs included, as Triton's launcher does."""

    function = "interpreted"

    def __init__(self, jit: Any) -> None:
        self.jit = jit

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        names = self.jit.arg_names

        def run(*args: Any) -> None:
            self.jit[grid](**dict(zip(names, args, strict=True)))

        return run


class _Interpreted:
    """The interpreter's kernel, returning a `_Compiled` as the compiled-mode JIT does."""

    def __init__(self, jit: Any) -> None:
        self.jit = jit

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.jit[grid](*args, **kwargs)
            return _Compiled(self.jit)

        return run


def _direct_under_interpreter(jit: Any) -> DirectKernel:
    import inspect

    signature = inspect.signature(jit.fn).parameters.values()
    params = [(p.name, p.annotation is tl.constexpr or p.annotation == "tl.constexpr")
              for p in signature]
    return DirectKernel(_Interpreted(jit), params, device=lambda: 0)


def test_compiled_graphs_launch_every_kernel_directly_from_the_second_call(monkeypatch) -> None:
    """Each launcher (pointwise, tiled, row, looped row, split reduction) passes the
    same signature call after call, so only its first launch goes through the JIT;
    results stay equal to eager. Runs the kernels through the interpreter on a CPU
    (the compiled-mode JIT on a GPU)."""
    import rewritec
    from rewritec.runtime import recipe

    made: list[DirectKernel] = []
    cuda = torch.cuda.is_available()

    def make(jit: Any = None, **kw: Any) -> DirectKernel:
        k = DirectKernel(jit, **kw) if cuda else _direct_under_interpreter(jit)
        made.append(k)
        return k

    monkeypatch.setattr(recipe, "DirectKernel", make)
    # kernels of their own: an earlier test's graph may still hold a kernel of the same
    # source, which the weak registry would hand out instead of making one
    monkeypatch.setattr(recipe, "_SHARED", weakref.WeakValueDictionary())
    # On a GPU a launcher learns a plan on its first call and replays it without
    # passing through the DirectKernel (tests/test_launch_plans.py); counted here
    # are the launches of the path a plan replaces, so no plans.
    from rewritec.runtime import launch

    monkeypatch.setattr(launch.Launcher, "PLANS", 0)

    def f(x, y, w, v):
        z = torch.softmax(x * 2, dim=-1) + y
        return (z.sum(0), (x.relu() + y).t().contiguous(), torch.sin(y) * 3,
                torch.layer_norm(w, (w.shape[-1],)) * 2, v.sum())

    device = "cuda" if cuda else "cpu"
    x, y, w, v = (torch.randn(64, 48, device=device), torch.randn(64, 48, device=device),
                  torch.randn(3, 2500, device=device), torch.randn(200_000, device=device))
    compiled = rewritec.compile(f, target="triton", strict=True, cudagraphs="off")
    for _ in range(3):
        for got, want in zip(compiled(x, y, w, v), f(x, y, w, v), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    launched = [k for k in made if k.jitted or k.direct]
    assert len(launched) >= 8, len(launched)
    # a kernel whose binary another test stored (runtime/static_launch.py) skips the JIT
    # from its first call
    # (on a GPU, a new call's binary is compiled ahead, by the compile worker or by the
    # JIT without launching, and launched statically at once)
    assert all(k.jitted + k.stored + k.ahead + k.from_worker == len(k.runners) > 0
               and k.direct == 2 * k.jitted + 3 * (k.stored + k.ahead + k.from_worker)
               for k in launched), \
        [(k.jitted, k.stored, k.ahead, k.from_worker, k.direct, len(k.runners), k.disabled)
         for k in launched]
