"""CUDA-graph replay of inference graphs (codegen/cudagraphs.py, Options.cudagraphs).

The eligibility rules and the option run everywhere; replay itself needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.codegen.cudagraphs import CudaGraphRunner, eligible
from rewritec.engine.errors import RewritecError
from rewritec.options import Options


def _graph(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_only_pure_inference_graphs_are_eligible() -> None:
    x = torch.randn(4, 8)
    pure = _graph(lambda x: torch.relu(x) * 2.0, x)
    assert eligible(pure, "inference", aliased_outputs=False) is None
    assert "forward" in eligible(pure, "forward", aliased_outputs=False)
    assert "aliases" in eligible(pure, "inference", aliased_outputs=True)
    noisy = _graph(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), x)
    assert eligible(noisy, "inference", aliased_outputs=False) is not None
    mutating = _graph(lambda x: x.add_(1.0), x)
    assert eligible(mutating, "inference", aliased_outputs=False) is not None


def test_option_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Options.make().cudagraphs == "auto"
    monkeypatch.setenv("REWRITEC_CUDAGRAPHS", "off")
    assert Options.make().cudagraphs == "off"
    with pytest.raises(RewritecError, match="cudagraphs must be one of"):
        Options.make(cudagraphs="always")



class RecordingOnCpu(CudaGraphRunner):
    """The runner with a stand-in for CUDA-graph recording: a "replay" runs the
    wrapper again on the tensors it was recorded with and writes the results into
    the recorded outputs, as a real replay overwrites the graph's memory."""

    recorded: list[bool] = []  # per recording: did it read the caller's tensors?

    @staticmethod
    def _accepts(args):
        return True

    def _record(self, inputs):
        outputs = self.fn(inputs)

        def replay() -> None:
            for out, new in zip(outputs, self.fn(inputs), strict=True):
                out.copy_(new)

        return replay, outputs


def _runner():
    def wrapper(args):  # what a compiled graph's wrapper is: boxed arguments, a tuple out
        x, w = args
        return (x * 2 + w, x.sum(0))

    return RecordingOnCpu(wrapper, params=[False, True], mode="on"), torch.randn(4)


def _eager(x, w):
    return (x * 2 + w, x.sum(0))


def _check(got, x, w) -> None:
    for g, e in zip(got, _eager(x, w), strict=True):
        torch.testing.assert_close(g, e)


def test_a_loop_holding_its_last_result_alternates_two_graphs() -> None:
    runner, w = _runner()
    y = None
    for _ in range(8):
        x = torch.randn(3, 4)
        y = runner([x, w])  # the previous y is alive while this call runs
        _check(y, x, w)
    entry, = runner.graphs.values()
    assert len(entry.slots) == 2 and runner.plain == 0
    assert all(s.buffers is not None for s in entry.slots)  # new tensors: copied in


def test_results_still_held_are_never_overwritten() -> None:
    runner, w = _runner()
    xs = [torch.randn(3, 4) for _ in range(6)]
    kept = [runner([x, w]) for x in xs]
    view = runner([xs[0], w])[0].view(-1)  # only a view of a result survives
    later = runner([xs[1], w])
    for x, got in zip(xs, kept, strict=True):
        _check(got, x, w)
    torch.testing.assert_close(view, _eager(xs[0], w)[0].view(-1))
    _check(later, xs[1], w)
    assert runner.plain >= 4  # both graphs busy: the plain wrapper ran those calls


def test_an_input_refilled_in_place_is_read_where_it_is() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        _check(runner([x, w]), x, w)
    entry, = runner.graphs.values()
    assert len(entry.slots) == 1 and entry.slots[0].buffers is None
    other = torch.randn(3, 4)  # another tensor: not the one the graph reads
    _check(runner([other, w]), other, w)
    assert len(entry.slots) == 2 and entry.slots[1].buffers is not None


def test_a_result_resized_away_from_the_graph_memory_retires_its_graph() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    runner([x, w])
    first = runner([x, w])[0]  # recorded, replayed
    first.resize_(10_000)  # new memory for the shared storage
    del first
    for _ in range(3):
        x = torch.randn(3, 4)
        _check(runner([x, w]), x, w)


def test_a_parameter_updated_in_place_records_again() -> None:
    runner, w = _runner()
    x = torch.randn(3, 4)
    for _ in range(3):
        runner([x, w])
    w.add_(1.0)
    for _ in range(3):
        _check(runner([x, w]), x, w)
    another = torch.randn(4)  # a different parameter tensor: never written into
    _check(runner([x, another]), x, another)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.ln(x)))


@cuda
def test_replay_matches_eager_and_keeps_earlier_results() -> None:
    torch.manual_seed(0)
    model = Block().cuda().eval()
    compiled = rewritec.compile(model, cudagraphs="on", strict=True)
    xs = [torch.randn(8, 16, 64, device="cuda") for _ in range(4)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]  # the 2nd call captures, later ones replay
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
        # a parameter updated in place: the graph is recorded again
        model.fc.bias.add_(1.0)
        for _ in range(3):
            torch.testing.assert_close(compiled(xs[0]), model(xs[0]), rtol=1e-4, atol=1e-4)
        # a new shape gets its own graph; CPU tensors never reach a graph
        y = torch.randn(3, 5, 64, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-4)
    assert any("recorded" in r.cudagraphs for r in report.RECORDS)



@cuda
def test_replay_of_a_loop_and_of_a_refilled_input_matches_eager() -> None:
    """Real CUDA graphs: a buffer refilled in place is read where it is, a loop
    `y = f(x)` over new tensors alternates graphs, and a result kept aside is never
    overwritten by later replays."""
    torch.manual_seed(0)
    model = Block().cuda().eval()
    compiled = rewritec.compile(model, cudagraphs="on", strict=True)
    x = torch.randn(8, 16, 64, device="cuda")
    with torch.no_grad():
        y = None
        for _ in range(5):
            x.copy_(torch.randn_like(x))
            y = compiled(x)
            torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
        kept, kept_x = y, x.clone()
        for _ in range(5):
            z = torch.randn_like(x)
            y = compiled(z)
            torch.testing.assert_close(y, model(z), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept, model(kept_x), rtol=1e-4, atol=1e-4)

@cuda
def test_auto_leaves_short_graphs_alone() -> None:
    """Under auto, a graph of a few launches runs plainly (copies would cost more)."""
    model = Block().cuda().eval()
    report.reset()
    compiled = rewritec.compile(model, strict=True)
    x = torch.randn(2, 4, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    decided = [r.cudagraphs for r in report.RECORDS if r.cudagraphs]
    assert decided and all("fewer than" in d for d in decided)


def test_auto_threshold_counts_launches_and_products() -> None:
    """auto replays graphs of 3+ launches without matrix products (Python-bound:
    conv + epilogues), but needs 12+ where cuBLAS products keep the GPU busy."""
    from rewritec.codegen.cudagraphs import auto_declines

    conv_block = {"convolution": 1}, [{"template": "triton/pointwise_tiled"},
                                      {"template": "triton/pointwise"}]
    assert auto_declines(*conv_block) is None
    mlp = {"addmm": 2}, [{"template": "triton/pointwise"}]
    assert "with matrix products, fewer than 12" in auto_declines(*mlp)
    attention = {}, [{"template": "triton/attention"}] * 2 + [{"template": "triton/row"}] * 2
    assert "fewer than 12" in auto_declines(*attention)
    one_kernel = {}, [{"template": "triton/row"}]
    assert "1 launch(es) without matrix products, fewer than 3" in auto_declines(*one_kernel)
    many = {"addmm": 6}, [{"template": "triton/row"}] * 6
    assert auto_declines(*many) is None
