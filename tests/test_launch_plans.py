"""Launch plans (runtime/launch.py: Launcher._learn): after a launch through a
remembered runner, later launches with the same input signature allocate the
output and call the runner directly, skipping the geometry and key work. On the
GPU the runner is Triton's; here a stand-in kernel runs on the CPU."""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec.runtime import launch
from rewritec.runtime.launch import Launcher


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
        # a tensor made during the launch, as an input made contiguous first would be
        args = (x, y, out, out.numel()) + ((x.clone(),) if self.extra_tensor else ())
        self.kernel.run(x, y, out, out.numel(), 2.0)
        if self.kernel.watch is not None:
            self.kernel.watch.append((lambda *a: self.kernel.run(*a[:4], a[-1]), args, (2.0,)))
        return out


pytestmark = pytest.mark.usefixtures("plans_on_the_cpu")


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
    # learned once: the signature is marked as having no plan, and not watched again
    assert axpy.full == 3 and list(axpy.plans.values()) == [launch.NO_PLAN]


class Counted(Kernel):
    """A stand-in with a DirectKernel's launch counters."""

    direct = 0
    jitted = 0

    def record(self, run, args, tail=()) -> None:
        self.direct += 1
        run(*args, *tail)
        if self.watch is not None:
            self.watch.append((run, args, tail))


class SplitSum(Launcher):
    """A launcher that launches twice through two kernels, with a scratch tensor
    between them, as a split reduction does (runtime/reduction_launch.py)."""

    def __init__(self, partial: Counted, combine: Counted, jit_combine: bool = False) -> None:
        super().__init__(spec=None, kernel=partial, fallback=lambda x: x.sum(0) * 3.0)
        self.combine = combine
        self.full = 0
        self.jit_combine = jit_combine
        self.plans = {}

    def watched(self):
        return (self.kernel, self.combine)

    def launch(self, x):
        self.full += 1
        out = torch.empty(x.shape[1:], dtype=x.dtype)
        part = torch.empty((2, *x.shape[1:]), dtype=torch.float32)
        if self.temps is not None:
            self.temps.append(part)
        half = x.shape[0] // 2

        def partial(x, part, half, out_again):
            part[0] = x[:half].float().sum(0)
            part[1] = x[half:].float().sum(0)

        def combine(part, out, scale):
            out.copy_(part.sum(0) * scale)

        self.kernel.record(partial, (x, part, half, out))
        if self.jit_combine:  # a launch through the JIT is counted but not watched
            self.combine.jitted += 1
            combine(part, out, 3.0)
        else:
            self.combine.record(combine, (part, out), (3.0,))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_launches_and_scratch_tensors_are_one_plan(dtype: torch.dtype) -> None:
    split = SplitSum(Counted(), Counted())
    for rows in [6, 6, 8, 6, 8, 8]:
        x = torch.randn(rows, 5, dtype=dtype)
        torch.testing.assert_close(split(x), (x.float().sum(0) * 3.0).to(dtype))
    assert split.full == 2  # one learning launch per signature
    assert all(isinstance(p, launch._Steps) for p in split.plans.values())
    # each replay allocates its own scratch tensor: two results alive at once differ
    a, b = torch.ones(6, 5), torch.full((6, 5), 2.0)
    ra, rb = split(a), split(b)
    torch.testing.assert_close(ra, torch.full((5,), 18.0))
    torch.testing.assert_close(rb, torch.full((5,), 36.0))


def test_a_launch_the_watch_missed_is_not_learned() -> None:
    split = SplitSum(Counted(), Counted(), jit_combine=True)
    for _ in range(3):
        x = torch.randn(6, 5)
        torch.testing.assert_close(split(x), x.sum(0) * 3.0)
    assert split.full == 3 and split.plans == {}


def test_a_launch_marked_unlearnable_is_learned_at_the_next_call() -> None:
    axpy = Axpy(Kernel())
    x, y = torch.randn(4, 8), torch.randn(8)
    original = Axpy.launch

    def poisoned(self, x, y):
        if self.kernel.watch is not None and self.full == 0:
            self.kernel.watch.append(launch.POISON)  # as autotuning's timing does
        return original(self, x, y)

    axpy.launch = poisoned.__get__(axpy)
    for _ in range(3):
        torch.testing.assert_close(axpy(x, y), x * 2.0 + y)
    assert axpy.full == 2 and len(axpy.plans) == 1


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


class SumAndMean(SplitSum):
    """Two outputs written by two launches through two kernels, with a scratch
    tensor between them, the second output passed before the first: a `_Steps`
    plan that allocates both outputs."""

    def __init__(self, partial: Counted, combine: Counted) -> None:
        super().__init__(partial, combine)
        self.fallback = lambda x: (x.sum(0), x.mean(0, keepdim=True))

    def launch(self, x):
        self.full += 1
        out = torch.empty(x.shape[1:], dtype=x.dtype)
        out1 = torch.empty((1, *x.shape[1:]), dtype=x.dtype)
        part = torch.empty((2, *x.shape[1:]), dtype=torch.float32)
        if self.temps is not None:
            self.temps.append(part)
        half = x.shape[0] // 2

        def partial(x, part, half):
            part[0] = x[:half].float().sum(0)
            part[1] = x[half:].float().sum(0)

        def combine(part, out1, out, rows):
            out.copy_(part.sum(0))
            out1.copy_(part.sum(0, keepdim=True) / rows)

        self.kernel.record(partial, (x, part, half))
        self.combine.record(combine, (part, out1, out), (x.shape[0],))
        return out, out1


def test_several_launches_allocate_every_output() -> None:
    both = SumAndMean(Counted(), Counted())
    for rows in [6, 6, 8, 6, 8]:
        x = torch.randn(rows, 5)
        got = both(x)
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got[0], x.sum(0))
        torch.testing.assert_close(got[1], x.mean(0, keepdim=True))
    assert both.full == 2
    assert all(isinstance(p, launch._Steps) and len(p.outs) == 2
               for p in both.plans.values())
    # each replay allocates its own outputs: two results alive at once differ
    ra, rb = both(torch.ones(6, 5)), both(torch.full((6, 5), 2.0))
    torch.testing.assert_close(ra[1], torch.ones(1, 5))
    torch.testing.assert_close(rb[1], torch.full((1, 5), 2.0))
    assert ra[0] is not rb[0] and ra[1] is not ra[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,cols", [(65536, 64), (64, 4096)])
def test_reductions_on_the_gpu_replay_their_plans(monkeypatch: pytest.MonkeyPatch,
                                                  rows: int, cols: int) -> None:
    """A split reduction (its kernel, a scratch tensor, its combine) and an unsplit
    one learn a plan on a real GPU, and the replays stay right."""
    import gc

    from rewritec.runtime.reduction_launch import ReductionTritonLauncher

    monkeypatch.undo()  # the real device, allocator and current-device query

    def f(x):
        return (x * 2.0).sum(0)

    compiled = rewritec.compile(f)
    for _ in range(5):
        x = torch.randn(rows, cols, device="cuda")
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-4, atol=1e-3)
    # type(), not isinstance(): the heap holds weak proxies whose referents are gone,
    # and isinstance() on one of those raises ReferenceError
    launchers = [o for o in gc.get_objects()
                 if issubclass(type(o), ReductionTritonLauncher) and o.plans]
    assert launchers, "no reduction launcher learned a plan"
    plans = [p for lr in launchers for p in lr.plans.values()]
    assert any(p is not launch.NO_PLAN for p in plans)


@pytest.mark.parametrize("shapes", [[(4, 1), (3,)], [(2, 1, 5), (7, 1)], [(0, 3), (1, 3)],
                                    [()], [(5,), ()], [(2, 3), (4, 3)], [(0,), (2,)]])
def test_broadcast_sizes_is_torchs(shapes: list[tuple[int, ...]]) -> None:
    """The launchers' broadcast (which spares a first launch torch's sympy import)."""
    try:
        want = list(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        with pytest.raises(RuntimeError, match="do not broadcast"):
            launch.broadcast_sizes(shapes)
        return
    assert launch.broadcast_sizes(shapes) == want
