"""Graphs that update their own inputs (aten/input_writes.py): BatchNorm's running
statistics in training and buffers a model updates itself are written by the
compiled graph, in one call after its kernels, and every value equals eager's."""

from __future__ import annotations

import copy

import pytest
import torch

from rewritec import report
from rewritec.aten.input_writes import split_input_writes, write_back


class ConvNet(torch.nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8, momentum=momentum)
        self.conv2 = torch.nn.Conv2d(8, 6, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(6, momentum=momentum)
        self.head = torch.nn.Linear(6, 5)
        self.bn3 = torch.nn.BatchNorm1d(5, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h = self.bn2(self.conv2(h)).mean((2, 3))
        return self.bn3(self.head(h))


def _same_state(model: torch.nn.Module, ref: torch.nn.Module, grads: bool = True) -> None:
    for (name, b), (_, e) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, e, msg=lambda m, n=name: f"buffer {n}: {m}")
    if grads:
        for (name, p), (_, e) in zip(model.named_parameters(), ref.named_parameters(),
                                     strict=True):
            torch.testing.assert_close(p.grad, e.grad, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, n=name: f"grad of {n}: {m}")


def _forward_records() -> list[report.GraphRecord]:
    return [r for r in report.RECORDS if r.kind == "forward"]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(4, 3, 6, 6), (3, 3, 5, 7)])
def test_batch_norm_training_updates_its_statistics_in_the_graph(
        momentum: float | None, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = ConvNet(momentum)
    ref = copy.deepcopy(model)
    report.reset()
    compiled = torch.compile(model, backend="rewritec")
    for _ in range(3):
        x = torch.randn(shape)
        for m, fn in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
        _same_state(model, ref)
    if momentum is None:
        return  # its float(num_batches_tracked) breaks the graph around each batch norm
    (fw,) = _forward_records()
    assert fw.status == "compiled", fw.reason
    # running mean, running variance and the batch count of each of three batch norms
    assert fw.input_writes == 9


def test_gradients_accumulated_over_two_forwards_see_unchanged_saved_tensors() -> None:
    """The second forward updates the running statistics before the first backward
    runs: the backward must not have saved them (autograd would refuse)."""
    torch.manual_seed(1)
    model = ConvNet()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="rewritec")
    xs = [torch.randn(4, 3, 6, 6) for _ in range(2)]
    losses = [compiled(x).square().mean() for x in xs]
    sum(losses).backward()
    want = sum(ref(x).square().mean() for x in xs)
    want.backward()
    torch.testing.assert_close(sum(losses), want)
    _same_state(model, ref)


def test_batch_norm_under_bf16_autocast_keeps_fp32_statistics() -> None:
    torch.manual_seed(2)
    model = ConvNet()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="rewritec")
    for _ in range(2):
        x = torch.randn(4, 3, 6, 6)
        for m, fn in ((model, compiled), (ref, ref)):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(x)
            out.float().square().mean().backward()
    for b, e in zip(model.buffers(), ref.buffers(), strict=True):
        assert b.dtype == e.dtype
        torch.testing.assert_close(b, e, rtol=2e-2, atol=2e-2)


class Counting(torch.nn.Module):
    """A model that updates buffers of its own: a step count and a running average
    of its input, then reads neither again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("average", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        self.steps.add_(1)
        self.average.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return y


@pytest.mark.parametrize("grad", [True, False])
def test_buffers_a_model_updates_itself_equal_eager(grad: bool) -> None:
    torch.manual_seed(3)
    model = Counting()
    ref = copy.deepcopy(model)
    report.reset()
    compiled = torch.compile(model, backend="rewritec")
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x = torch.randn(5, 6)
            torch.testing.assert_close(compiled(x), ref(x))
    _same_state(model, ref, grads=False)
    assert int(model.steps) == 3
    writes = [r.input_writes for r in report.RECORDS if r.kind in ("forward", "inference")]
    assert writes == [2], writes


def _traced(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_a_write_the_graph_reads_after_stays_in_the_graph() -> None:
    def reads_after(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        torch.ops.aten.copy_.default(buf, x * 2)
        return buf + 1

    gm = _traced(reads_after, torch.randn(4), torch.randn(4))
    assert split_input_writes(gm) is None

    def twice(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        torch.ops.aten.copy_.default(buf, x * 2)
        torch.ops.aten.copy_.default(buf, x * 3)
        return x + 1

    assert split_input_writes(_traced(twice, torch.randn(4), torch.randn(4))) is None


def test_split_graph_written_back_equals_the_graph() -> None:
    def step(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        torch.ops.aten.copy_.default(a, a * 0.9 + x)
        torch.ops.aten.copy_.default(b, b + x.sum())
        torch.ops.aten.copy_.default(c, x[:2].to(torch.float64))  # a cast: one copy_
        return (x * 2, x.sum())

    args = [torch.randn(4), torch.randn(4), torch.randn(4), torch.zeros(2, dtype=torch.float64)]
    gm = _traced(step, *[a.clone() for a in args])
    split = split_input_writes(gm)
    assert split is not None
    new_gm, inputs, results = split
    assert inputs == [1, 2, 3] and results == 2

    def boxed(a: list[torch.Tensor]):
        out = new_gm(*a)
        a.clear()  # as a boxed call may: write_back keeps its own references
        return out

    mine = [a.clone() for a in args]
    theirs = [a.clone() for a in args]
    got = write_back(boxed, inputs, results, False)(list(mine))
    want = gm(*theirs)
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    for g, w in zip(mine, theirs, strict=True):
        torch.testing.assert_close(g, w)
