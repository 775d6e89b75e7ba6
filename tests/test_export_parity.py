"""Export path parity: a model compiled through `torch.export` (frontend/export.py,
what `rewritec compile` does with a script's `model`) reaches the same rules and
kernels as through `torch.compile(backend="rewritec")`, and both equal eager.

The differences this suite knows of are the models', not rewritec's: a model that
asks whether it is being exported takes another path.
- Under torch.compile and no_grad, nn.TransformerEncoderLayer takes its inference fast
  path (one ATen op, `_transformer_encoder_layer_fwd`, that no rule decomposes), while
  export traces the layer's Python math. The encoder is compared with that fast path
  off, and `test_encoder_fast_path_is_the_models_choice` pins the difference.
- transformers' BERT builds its padding mask only under export (masking_utils skips
  an all-ones mask unless `is_torchdynamo_exporting()`); the mask's ops are folded
  or computed in kernels, so both paths still reach the same kernels and leave the
  same ops outside: `test_bert_reaches_the_same_kernels_under_export`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import MLP, GPT2Block, ParamArith, SmallCNN, no_fallback, tol
from torch import nn

from rewritec import report
from rewritec.benchmarks.model_zoo import BY_NAME, TINY_BATCH, no_cache
from rewritec.engine.errors import RewritecError
from rewritec.frontend.export import export_and_compile
from rewritec.options import Options


class LinearGeluSoftmax(nn.Module):
    """The issue's model: export kept aten.linear and aten.softmax.int whole, so no
    rule fired on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.gelu(self.fc1(x))), dim=-1)


class Logits(nn.Module):
    """A transformers model called on input ids alone, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, **no_cache(self.model)).logits


def _zoo(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """The suite's tiny config of `name` (benchmarks/model_zoo.py)."""
    spec = BY_NAME[name]
    if spec.missing():
        pytest.skip(spec.missing())
    built = spec.build(True)
    inputs = built.make_inputs(TINY_BATCH, torch.device("cpu"))
    if "src" in inputs:
        return built.model, (inputs["src"],)
    return Logits(built.model), (inputs["input_ids"],)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "linear_gelu_softmax": lambda: (LinearGeluSoftmax(), (torch.randn(4, 16),)),
    "mlp": lambda: (MLP(), (torch.randn(4, 16),)),
    "small_cnn": lambda: (SmallCNN(), (torch.randn(2, 3, 8, 8),)),
    "gpt2_block": lambda: (GPT2Block(), (torch.randn(2, 16, 32),)),
    "param_arith": lambda: (ParamArith(), (torch.randn(4, 8),)),
    "torch_encoder": lambda: _zoo("torch_encoder"),
    "gpt2": lambda: _zoo("gpt2"),
    "llama": lambda: _zoo("llama"),
}


@contextmanager
def mha_fast_path(enabled: bool) -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def reached() -> tuple[Counter[str], int, Counter[str]]:
    """What the graphs compiled since the last report.reset() reached: the fired
    rules (a multiset), the number of kernels and the ops left outside them."""
    rules: Counter[str] = Counter()
    fallback: Counter[str] = Counter()
    for r in report.RECORDS:
        rules.update(r.rules_fired)
        fallback.update(r.fallback_ops)
    return rules, sum(len(r.kernels) for r in report.RECORDS), fallback


def both_paths(model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Compile `model` in inference through export and through torch.compile; per
    path, what it reached, and its result checked against eager."""
    model.eval()
    paths: dict[str, Any] = {}
    with torch.no_grad():
        want = model(*inputs)
        report.reset()
        with no_fallback(("export",)):
            got = export_and_compile(model, inputs, Options.make())(*inputs)
        torch.testing.assert_close(got, want, **tol(torch.float32))
        paths["export"] = reached()
        report.reset()
        torch._dynamo.reset()
        with no_fallback(("inference",)):
            got = torch.compile(model, backend="rewritec")(*inputs)
        torch.testing.assert_close(got, want, **tol(torch.float32))
        paths["torch.compile"] = reached()
    return paths


@pytest.mark.parametrize("name", list(MODELS))
def test_export_reaches_what_torch_compile_reaches(name: str) -> None:
    model, inputs = MODELS[name]()
    with mha_fast_path(False):
        paths = both_paths(model, inputs)
    (rules, kernels, fallback), want = paths["export"], paths["torch.compile"]
    assert rules == want[0], f"rules: export {rules}, torch.compile {want[0]}"
    assert kernels == want[1]
    assert fallback == want[2]
    assert rules and kernels, "both paths reached nothing: nothing was compared"


def test_encoder_fast_path_is_the_models_choice() -> None:
    """With its fast path on, the encoder hands torch.compile one fused ATen op per
    layer and export the layer's math: the export path reaches more, not less."""
    model, inputs = MODELS["torch_encoder"]()
    with mha_fast_path(True):
        paths = both_paths(model, inputs)
    assert paths["torch.compile"][2]["_transformer_encoder_layer_fwd"] == 2
    assert paths["export"][1] > paths["torch.compile"][1]



def test_bert_reaches_the_same_kernels_under_export() -> None:
    """Export reaches every rule torch.compile reaches, the same kernels and leaves
    the same ops outside them. Under export BERT builds its attention mask in the
    graph (arange, where over the positions): those are folded or run in kernels, so
    nothing is left outside that torch.compile does not leave too."""
    model, inputs = _zoo("bert")
    paths = both_paths(model, inputs)
    (rules, kernels, fallback), want = paths["export"], paths["torch.compile"]
    assert not want[0] - rules, f"rules only torch.compile reached: {want[0] - rules}"
    assert kernels == want[1], (kernels, want[1])
    assert fallback == want[2], f"only under export: {fallback - want[2]}"


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin() if x.sum() > 0 else x.cos()  # data-dependent: export refuses it


def test_a_model_export_refuses_is_one_clear_error() -> None:
    with pytest.raises(RewritecError, match=r"^torch.export cannot export Branchy: \w+") as e:
        export_and_compile(Branchy(), (torch.randn(4),), Options.make())
    assert len(str(e.value).splitlines()) == 1
