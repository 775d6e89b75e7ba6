"""Regional compilation (aten/regions.py): a block marked with
`torch.compiler.nested_compile_region` compiles once, however many layers call it,
forward and backward, and the model still computes what eager computes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from models import check_module, compile_strict, no_fallback, tol
from torch import nn

import rewritec
from rewritec import report
from rewritec.compiler import RewritecWarning

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason="torch.compiler.nested_compile_region is newer")


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class RegionalBlock(Block):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.softmax(-1)


def kinds() -> list[str]:
    return sorted(r.kind for r in report.RECORDS)


def test_inference_compiles_the_block_once() -> None:
    model = Stack(RegionalBlock).eval()
    check_module(model, [torch.randn(2, 4, 16)], compile_strict, no_grad=True,
                 kinds=("inference", "region"))
    assert kinds() == ["inference", "region"]
    outer, region = sorted(report.RECORDS, key=lambda r: r.kind)
    assert region.rules_fired["layer-norm"] == 1 and region.kernels
    # a call of a compiled region is no ATen op left outside kernels
    assert not [op for op in outer.fallback_ops if "invoke_subgraph" in op], outer.fallback_ops


def test_training_compiles_the_blocks_forward_and_backward_once() -> None:
    check_module(Stack(RegionalBlock), [torch.randn(2, 4, 16)], compile_strict,
                 kinds=("forward", "backward", "region"))
    assert kinds() == ["backward", "forward", "region", "region"]


def test_regional_work_is_a_fraction_of_the_whole() -> None:
    """The measure of compile time that does not depend on the machine: the rules
    that fire and the kernels generated. Whole, 8 blocks are 8 times a block's;
    regional, one block's plus the graph around it."""
    x = torch.randn(2, 4, 16)
    work = {}
    for block in (Block, RegionalBlock):
        report.reset()
        torch._dynamo.reset()
        with torch.no_grad(), no_fallback():
            rewritec.compile(Stack(block), strict=True)(x)
        work[block] = (sum(sum(r.rules_fired.values()) for r in report.RECORDS),
                       sum(len(r.kernels) for r in report.RECORDS))
    (rules, kernels), (whole_rules, whole_kernels) = work[RegionalBlock], work[Block]
    assert rules * 4 < whole_rules and kernels * 4 < whole_kernels, work


def test_a_region_per_distinct_block() -> None:
    """Two kinds of block, each repeated: two regions, not four."""

    class Other(Block):
        @torch.compiler.nested_compile_region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().forward(x))

    model = nn.Sequential(RegionalBlock(), Other(), RegionalBlock(), Other()).eval()
    x = torch.randn(2, 4, 16)
    with torch.no_grad(), no_fallback(("inference", "region")):
        torch.testing.assert_close(rewritec.compile(model, strict=True)(x), model(x),
                                   **tol(torch.float32))
    assert kinds().count("region") == 2


def test_a_region_inside_a_region() -> None:
    """A region whose block calls another region compiles and equals eager, forward
    and backward (whether the inner region stays a call is torch's choice)."""

    class Outer(RegionalBlock):
        @torch.compiler.nested_compile_region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(super().forward(x))

    check_module(nn.Sequential(Outer(), Outer(), Outer()), [torch.randn(2, 4, 16)],
                 compile_strict, kinds=("forward", "backward", "region"))


class TwoInTwoOut(nn.Module):
    """A region of two operands and two results, one a reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        return h + skip, h.sum(-1)


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TwoInTwoOut() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a copy: torch 2.13's Dynamo computes wrong results, whatever the backend, for
        # a region given one tensor as two operands
        skip, total = x.clone(), torch.zeros(())
        for block in self.blocks:
            x, t = block(x, skip)
            total = total + t
        return x, total


def test_a_region_of_two_operands_and_two_results() -> None:
    check_module(Skips(), [torch.randn(3, 16)], compile_strict,
                 kinds=("forward", "backward", "region"))
    assert kinds().count("region") == 2


class Counting(nn.Module):
    """A region that writes to a buffer: AOTAutograd wraps it in auto_functionalized."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.tanh(self.fc(x))


def test_region_that_writes_a_buffer_falls_back_with_one_warning() -> None:
    model = nn.Sequential(Counting(), Counting())
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = rewritec.compile(model)(x)
    [warning] = [w for w in caught if issubclass(w.category, RewritecWarning)]
    assert "writes to a tensor it is given" in str(warning.message)
    assert len(str(warning.message).splitlines()) == 1
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))
    assert [float(m.calls) for m in model] == [2.0, 2.0]  # once compiled, once eager


def test_strict_names_the_region_that_writes() -> None:
    with torch.no_grad(), pytest.raises(Exception, match="writes to a tensor it is given"):
        rewritec.compile(nn.Sequential(Counting(), Counting()), strict=True)(torch.randn(2, 8))


def test_a_region_called_with_another_layout_gets_its_own_fake_values() -> None:
    """A call whose operands differ in strides from the subgraph's own placeholders
    compiles the region on a copy with fake values propagated anew."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from rewritec.aten.regions import _layout, _typed

    with FakeTensorMode() as mode:
        sub = make_fx(lambda x: (x * 2.0).sin())(mode.from_tensor(torch.randn(4, 6)))
        transposed = mode.from_tensor(torch.randn(6, 4)).t()
    typed = _typed(sub, [transposed])
    assert typed is not sub and _typed(sub, [next(iter(sub.graph.nodes)).meta["val"]]) is sub
    assert [n.meta["val"].stride() for n in typed.graph.nodes if n.op == "placeholder"] \
        == [(1, 4)]
    assert _layout([next(iter(sub.graph.nodes)).meta["val"]]) != _layout([transposed])


def test_region_bodies_are_what_cuda_graph_replay_checks() -> None:
    """compiler._maybe_cudagraphs checks the bodies of a graph's regions as it checks
    the graph: a replay runs their kernels too."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from rewritec.aten.regions import region_bodies

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep,
                                     inference_compiler=keep)

    with torch.no_grad():
        torch.compile(Stack(RegionalBlock, 3), backend=backend)(torch.randn(2, 4, 16))
    [body] = region_bodies(graphs[0])
    assert any(n.target is torch.ops.aten.native_layer_norm.default for n in body.graph.nodes)


def test_cuda_graph_auto_counts_what_each_region_call_launches(monkeypatch) -> None:
    """cudagraphs=auto replays a graph of enough launches: a graph that calls a region
    8 times launches the region's kernels 8 times (compiler.launched)."""
    from rewritec import compiler

    seen = []
    real = compiler._maybe_cudagraphs

    def spy(fn, gm, kind, params, opts, rec, pool=None, regions=None):  # type: ignore[no-untyped-def]
        if kind != "region":
            seen.append(compiler.launched(rec, regions or []))
        return real(fn, gm, kind, params, opts, rec, pool, regions)

    monkeypatch.setattr(compiler, "_maybe_cudagraphs", spy)
    with torch.no_grad(), no_fallback():
        rewritec.compile(Stack(RegionalBlock), strict=True)(torch.randn(2, 4, 16))
    outer, region = sorted(report.RECORDS, key=lambda r: r.kind)
    [(ops, kernels)] = seen
    assert len(kernels) == len(outer.kernels) + 8 * len(region.kernels)
    assert ops["addmm"] == 8 * region.fallback_ops["addmm"] > 0
