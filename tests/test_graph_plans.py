"""Graph plans (runtime/graph_plans.py): a wrapper called twice with one input
signature gets a variant whose kernel lines allocate and launch directly. On the
GPU the launches are the static CUDA launcher's; here stand-in kernels run on the
CPU, through the same launch plans (runtime/launch.py) a GPU launcher learns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rewritec.runtime import graph_plans, launch
from rewritec.runtime.graph_plans import PlannedGraph, planned
from rewritec.runtime.launch import Launcher, NoLaunch
from rewritec.runtime.namespace import namespace


class Kernel:
    """Stands for a DirectKernel: `watch` collects (runner, args, constexprs)."""

    def __init__(self) -> None:
        self.watch = None
        self.runs = 0
        self.broken = False

    def run(self, x, y, *rest) -> None:
        if self.broken:
            raise RuntimeError("launch failed")
        self.runs += 1
        *outs, n, scale = rest
        outs[0].copy_(x * scale + y)
        if len(outs) > 1:
            outs[1].copy_(x - y)


class Axpy(Launcher):
    """`x * 2 + y` (and `x - y` with `two=True`), launched through `Kernel`."""

    def __init__(self, kernel: Kernel, two: bool = False, refuse: torch.Size | None = None):
        fallback = (lambda x, y: (x * 2.0 + y, x - y)) if two else (lambda x, y: x * 2.0 + y)
        super().__init__(spec=SimpleNamespace(name="axpy", rule="fuse-axpy"), kernel=kernel,
                         fallback=fallback)
        self.two = two
        self.refuse = refuse  # inputs of this shape run through ATen (NoLaunch)
        self.plans = {}
        self.called = 0

    def __call__(self, *inputs):
        self.called += 1
        return super().__call__(*inputs)

    def launch(self, x, y):
        if self.refuse is not None and x.shape == self.refuse:
            raise NoLaunch("not for these sizes")
        shape = torch.broadcast_shapes(x.shape, y.shape)
        outs = [torch.empty(shape, dtype=x.dtype) for _ in range(2 if self.two else 1)]
        args = (x, y, *outs, outs[0].numel())
        self.kernel.run(*args, 2.0)
        if self.kernel.watch is not None:
            self.kernel.watch.append((self.kernel.run, args, (2.0,)))
        return tuple(outs) if self.two else outs[0]


@pytest.fixture(autouse=True)
def on_the_cpu(plans_on_the_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REWRITEC_GRAPH_PLANS", raising=False)


# The layout of runtime/wrapper.py's wrappers: ATen calls, kernel lines, views (a
# transpose, a reshape that copies, a slice at an offset, an expand), a launcher
# called by two lines, a kernel with two results, frees.
SOURCE = """
def call(args):
    a0, a1, a2, = args
    args.clear()
    v3 = aten.mul.Tensor(a0, a2)
    v4 = _k0(v3, a1)
    del v3
    v5 = aten.t.default(v4)
    v6 = aten.reshape.default(v5, [-1])
    v7 = _k1(v4, a1)
    v8 = v7[0]
    v9 = v7[1]
    del v7
    v10 = _k0(v8, v9)
    v11 = aten.slice.Tensor(v10, 1, 2, 6)
    v12 = aten.expand.default(a1, [3, -1])
    v13 = _k0(v11, v9[:, 1:5])
    return (v6, v10, v9.clone(), v13, v12, )
"""


def reference(a0, a1, a2):
    v4 = (a0 * a2) * 2.0 + a1
    v8, v9 = v4 * 2.0 + a1, v4 - a1
    v10 = v8 * 2.0 + v9
    return v4.t().reshape(-1), v10, v9, v10[:, 2:6] * 2.0 + v9[:, 1:5], a1.expand(3, -1)


def build(source: str = SOURCE, **scope):
    k0, k1 = Axpy(Kernel()), Axpy(Kernel(), two=True)
    names = {**namespace(), "_k0": k0, "_k1": k1, **scope}
    exec(compile(source, "<test wrapper>", "exec"), names)  # noqa: S102
    return planned(names["call"], source), k0, k1


def inputs(shape=(4, 8), dtype=torch.float32, strided=False):
    a0 = torch.randn(shape[0], shape[1] * (2 if strided else 1), dtype=dtype)
    a0 = a0[:, ::2] if strided else a0
    return a0, torch.randn(shape[1], dtype=dtype), torch.randn(shape, dtype=dtype)


def check(fn, xs) -> None:
    got = fn(list(xs))
    for g, w in zip(got, reference(*xs), strict=True):
        torch.testing.assert_close(g, w)


def test_a_graph_called_twice_runs_its_written_variant() -> None:
    fn, k0, k1 = build()
    assert isinstance(fn, PlannedGraph)
    xs = inputs()
    check(fn, xs)
    check(fn, xs)  # recorded: every kernel line went through a plan
    # four launches, the transpose, the slice and the expand; the reshape copies
    assert len(fn.variants) == 1 and fn.planned_lines == 7
    source = next(iter(fn.sources.values()))
    assert "v5 = _rt(v4, (8, 4), (1, 8), 0)" in source
    assert "v11 = _rt(v10, (4, 4), (8, 1), 2)" in source
    assert "v12 = _rt(a1, (3, 8), (0, 1), 0)" in source
    assert "aten.reshape.default(v5, [-1])" in source
    called, runs = k0.called + k1.called, k0.kernel.runs + k1.kernel.runs
    for _ in range(3):
        check(fn, inputs())  # new values, one signature
    assert k0.called + k1.called == called  # no launcher was called
    assert k0.kernel.runs + k1.kernel.runs == runs + 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape,strided", [((4, 8), False), ((3, 10), False), ((4, 8), True),
                                           ((1, 16), True)])
def test_each_signature_gets_its_own_variant(shape, strided, dtype) -> None:
    fn, _, _ = build()
    other = inputs((2, 7), dtype)
    for _ in range(3):
        check(fn, inputs(shape, dtype, strided))
        check(fn, other)
    assert len(fn.variants) == 2 and set(fn.calls.values()) == {-1}


def test_a_line_that_fell_back_stays_a_launcher_call() -> None:
    fn, k0, k1 = build()
    k1.refuse = torch.Size([4, 8])
    with pytest.warns(launch.KernelFallback):
        for _ in range(4):
            check(fn, inputs())
    assert fn.planned_lines == 6  # _k1's line goes through its launcher
    assert k1.called == 4 and k1.calls_fell_back == 4


def test_a_variant_that_raises_is_dropped_and_the_graph_runs_plainly() -> None:
    fn, k0, _ = build()
    xs = inputs()
    check(fn, xs)
    check(fn, xs)
    k0.kernel.broken = True
    with pytest.raises(RuntimeError, match="launch failed"):
        fn(list(xs))
    assert fn.broken and not fn.variants
    k0.kernel.broken = False
    check(fn, xs)  # the plain wrapper, through the launchers
    assert not fn.variants


@pytest.mark.parametrize("line", [
    "v3 = aten.nonzero.default(a0)",  # a size that depends on values
    "v3 = _f0(a0)",  # a Python callable: anything
    "v3 = torch.relu(a0)",
])
def test_a_graph_calling_what_may_depend_on_values_is_not_planned(line) -> None:
    source = SOURCE.replace("v3 = aten.mul.Tensor(a0, a2)", line)
    fn, _, _ = build(source, _f0=lambda x: x)
    assert not isinstance(fn, PlannedGraph)


def test_a_profiled_wrapper_and_the_switch_keep_the_plain_wrapper(monkeypatch) -> None:
    fn, _, _ = build(_start=lambda: 0.0)
    assert not isinstance(fn, PlannedGraph)
    monkeypatch.setenv("REWRITEC_GRAPH_PLANS", "0")
    assert not isinstance(build()[0], PlannedGraph)


def test_a_graph_without_learning_launchers_is_not_wrapped() -> None:
    source = "def call(args):\n    a0, = args\n    args.clear()\n    v1 = _k0(a0, a0)\n" \
             "    return (v1, )\n"
    k = Axpy(Kernel())
    k.plans = None  # a CPU launcher: no plans
    names = {**namespace(), "_k0": k}
    exec(compile(source, "<test wrapper>", "exec"), names)  # noqa: S102
    assert planned(names["call"], source) is names["call"]


def test_static_launches_are_written_with_their_grid_and_numbers(monkeypatch) -> None:
    """A runner of the static launcher carries what launching it takes
    (runtime/static_launch.py: `static`); the variant calls the launcher itself."""
    launched = []

    def static_launch(function, g0, g1, g2, warps, shared, codes, args, stream):
        launched.append((g0, g1, g2, warps, shared, codes, stream))
        function(*[a for a in args if a is not None], 2.0)

    monkeypatch.setattr(graph_plans, "STATIC_LAUNCH", static_launch)
    monkeypatch.setattr(graph_plans, "CURRENT_STREAM", lambda device: 100 + device)
    fn, k0, k1 = build()
    for k in (k0, k1):
        run = k.kernel.run
        keep = (0, 1, 2, 3) if k is k0 else (0, 1, 2, 3, 4)
        k.kernel.run = lambda *a, run=run: run(*a)
        k.kernel.run.static = (run, (7, 1, 1), 4, 0, "OOOl", keep, 1, 0)
    xs = inputs()
    check(fn, xs)
    check(fn, xs)
    check(fn, inputs())
    assert launched == [(7, 1, 1, 4, 0, "OOOl", 100)] * 4
    source = next(iter(fn.sources.values()))
    assert "_st0 = _stream(0)" in source and source.count("_lk(") == 4


class Counted:
    """A stand-in kernel with a DirectKernel's launch counters."""

    direct = 0
    jitted = 0

    def __init__(self) -> None:
        self.watch = None

    def record(self, run, args) -> None:
        self.direct += 1
        run(*args)
        if self.watch is not None:
            self.watch.append((run, args, ()))


class SplitSum(Launcher):
    """`x.sum(0) * 3` in two launches with a scratch tensor between them, as a split
    reduction launches (runtime/reduction_launch.py): a plan of several steps."""

    def __init__(self) -> None:
        super().__init__(spec=SimpleNamespace(name="sum", rule="fuse-sum"), kernel=Counted(),
                         fallback=lambda x: x.sum(0) * 3.0)
        self.combine = Counted()
        self.plans = {}

    def watched(self):
        return (self.kernel, self.combine)

    def launch(self, x):
        out = torch.empty(x.shape[1:], dtype=x.dtype)
        part = torch.empty((2, *x.shape[1:]), dtype=x.dtype)
        if self.temps is not None:
            self.temps.append(part)
        half = x.shape[0] // 2

        def partial(x, part, half):
            part.copy_(torch.stack([x[:half].sum(0), x[half:].sum(0)]))

        def combine(part, out, scale):
            out.copy_(part.sum(0) * scale)

        self.kernel.record(partial, (x, part, half))
        self.combine.record(combine, (part, out, 3.0))
        return out


def test_a_launch_of_several_steps_is_written_out_with_its_scratch() -> None:
    source = ("def call(args):\n    a0, = args\n    args.clear()\n    v1 = _k0(a0)\n"
              "    v2 = aten.mul.Tensor(v1, v1)\n    return (v2, )\n")
    names = {**namespace(), "_k0": SplitSum()}
    exec(compile(source, "<test wrapper>", "exec"), names)  # noqa: S102
    fn = planned(names["call"], source)
    for shape in [(6, 5), (6, 5), (6, 5), (9, 2, 3), (9, 2, 3), (9, 2, 3)]:
        x = torch.randn(shape, dtype=torch.float64)
        torch.testing.assert_close(fn([x])[0], (x.sum(0) * 3.0) ** 2)
    assert len(fn.variants) == 2
    assert all("del _tv1_0" in s for s in fn.sources.values())


def test_a_wrapper_made_with_functools_wraps_stays_boxed() -> None:
    """torch._dynamo.disable wraps a compiled graph so: AOTAutograd then calls the
    wrapper with one list only if `_boxed_call` was copied over."""
    import functools

    fn = build()[0]
    wrapped = functools.wraps(fn)(lambda args: fn(args))
    assert getattr(wrapped, "_boxed_call", False)
    check(wrapped, inputs())


INDEXED = """
def call(args):
    a0, a1, a2, = args
    args.clear()
    v3 = aten.index.Tensor(a0, [a2])
    v4 = _k0(v3, a1)
    return (v4, )
"""


def test_an_index_by_positions_is_planned_and_by_a_mask_is_not() -> None:
    fn, k0, _ = build(INDEXED)
    x, y = torch.randn(4, 8), torch.randn(8)
    for order in ([3, 1, 0, 2], [0, 0, 1, 2], [2, 2, 2, 2]):
        at = torch.tensor(order)
        torch.testing.assert_close(fn([x, y, at])[0], x[at] * 2.0 + y)
    assert fn.planned_lines == 1 and len(fn.variants) == 1
    fn, _, _ = build(INDEXED)
    for keep in ([1, 1, 0, 1], [1, 1, 0, 1], [1, 0, 0, 0], [0, 1, 1, 1]):
        mask = torch.tensor(keep, dtype=torch.bool)  # one signature, three sizes
        torch.testing.assert_close(fn([x, y, mask])[0], x[mask] * 2.0 + y)
    assert not fn.variants
