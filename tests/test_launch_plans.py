"""Launch plans (codegen/launch.py: Launcher._learn): after a launch through a
remembered runner, later launches with the same input signature allocate the
output and call the runner directly, skipping the geometry and key work. On the
GPU the runner is Triton's; here a stand-in kernel runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from rewritec.codegen import launch
from rewritec.codegen.launch import Launcher


class Kernel:
    """Stands for a DirectKernel: `watch` collects (runner, args, constexprs)."""

    def __init__(self) -> None:
        self.watch = None
        self.runs = 0

    def run(self, x, y, out, n, scale) -> None:
        self.runs += 1
        out.copy_((x * scale + y).reshape(out.shape))


class Axpy(Launcher):
    """A launcher whose launch computes its geometry (counted) and launches once."""

    def __init__(self, kernel: Kernel, extra_tensor: bool = False) -> None:
        super().__init__(spec=None, kernel=kernel, fallback=lambda x, y: x * 2.0 + y)
        self.full = 0
        self.extra_tensor = extra_tensor
        self.plans = {}

    def launch(self, x, y):
        self.full += 1
        out = torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype)
        args = (x, y, out, out.numel()) + ((out,) if self.extra_tensor else ())
        self.kernel.run(x, y, out, out.numel(), 2.0)
        if self.kernel.watch is not None:
            self.kernel.watch.append((lambda *a: self.kernel.run(*a[:4], a[-1]), args, (2.0,)))
        return out


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "PLAN_DEVICE", "cpu")
    monkeypatch.setattr(launch, "_plan_device", lambda: -1)
    monkeypatch.setattr(launch, "_plan_alloc", lambda size, stride, dtype:
                        torch.empty_strided(size, stride, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_learned_plan_launches_without_the_full_path(dtype: torch.dtype) -> None:
    k = Kernel()
    axpy = Axpy(k)
    for shape in [(4, 8), (4, 8), (3, 5), (4, 8), (3, 5)]:
        x, y = torch.randn(shape, dtype=dtype), torch.randn(shape[-1:], dtype=dtype)
        torch.testing.assert_close(axpy(x, y), x * 2.0 + y)
    assert axpy.full == 2  # one learning launch per signature, plans after
    assert k.runs == 5 and len(axpy.plans) == 2


def test_another_stride_or_alignment_is_another_signature() -> None:
    axpy = Axpy(Kernel())
    base = torch.randn(4, 9)
    x, y = base[:, :8], torch.randn(8)
    torch.testing.assert_close(axpy(x.contiguous(), y), x * 2.0 + y)
    torch.testing.assert_close(axpy(x, y), x * 2.0 + y)  # strides (9, 1)
    shifted = base.reshape(-1)[1:33].reshape(4, 8)  # 4 bytes off: another alignment
    torch.testing.assert_close(axpy(shifted, y), shifted * 2.0 + y)
    assert axpy.full == 3 and len(axpy.plans) == 3


def test_a_launch_that_passes_more_tensors_is_not_learned() -> None:
    axpy = Axpy(Kernel(), extra_tensor=True)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(8)
        torch.testing.assert_close(axpy(x, y), x * 2.0 + y)
    assert axpy.full == 3 and axpy.plans == {}


def test_a_plan_that_fails_hands_back_to_the_full_path() -> None:
    k = Kernel()
    axpy = Axpy(k)
    x, y = torch.randn(4, 8), torch.randn(8)
    axpy(x, y)
    (plan,) = axpy.plans.values()

    def broken(*args):
        raise RuntimeError("launch failed")

    axpy.plans = {key: launch._Plan(p.outs, broken, p.rest)
                  for key, p in axpy.plans.items()}
    torch.testing.assert_close(axpy(x, y), x * 2.0 + y)
    assert axpy.plans is None and axpy.full == 2


def test_inputs_that_are_not_tensors_take_the_full_path() -> None:
    class Scaled(Axpy):
        def launch(self, x, y):
            self.full += 1
            return x * y

    axpy = Scaled(Kernel())
    x = torch.randn(4)
    for _ in range(3):
        torch.testing.assert_close(axpy(x, 3.0), x * 3.0)
    assert axpy.full == 3 and axpy.plans == {}


def test_an_output_on_another_device_than_the_current_one_is_not_planned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_plan_device", lambda: 1)  # "current": another device
    axpy = Axpy(Kernel())
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(8)
        torch.testing.assert_close(axpy(x, y), x * 2.0 + y)
    assert axpy.full == 3 and axpy.plans == {}


class AxpyAndSum(Launcher):
    """A kernel of two outputs (engine/fuse.py: side outputs): x * 2 + y, and x + y
    one value per row."""

    def __init__(self, kernel: Kernel) -> None:
        super().__init__(spec=None, kernel=kernel,
                         fallback=lambda x, y: (x * 2.0 + y, (x + y).sum(-1, keepdim=True)))
        self.full = 0
        self.plans = {}

    def launch(self, x, y):
        self.full += 1
        out = torch.empty(x.shape, dtype=x.dtype)
        out1 = torch.empty(x.shape[:-1] + (1,), dtype=x.dtype)

        def run(x, y, out, out1, n, scale) -> None:
            self.kernel.runs += 1
            out.copy_(x * scale + y)
            out1.copy_((x + y).sum(-1, keepdim=True))

        run(x, y, out, out1, out.numel(), 2.0)
        if self.kernel.watch is not None:
            self.kernel.watch.append((run, (x, y, out, out1, out.numel()), (2.0,)))
        return out, out1


def test_a_plan_allocates_every_output() -> None:
    k = Kernel()
    launcher = AxpyAndSum(k)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(8)
        got = launcher(x, y)
        want = (x * 2.0 + y, (x + y).sum(-1, keepdim=True))
        assert isinstance(got, tuple) and len(got) == 2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert launcher.full == 1 and k.runs == 3
    (plan,) = launcher.plans.values()
    assert [size for size, _, _ in plan.outs] == [(4, 8), (4, 1)]
