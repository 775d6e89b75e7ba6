"""CUDA-graph replay of inference graphs (codegen/cudagraphs.py, Options.cudagraphs).

The eligibility rules and the option run everywhere; replay itself needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.codegen.cudagraphs import eligible
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
