"""The layout phase (passes/layout.py): convolutions in channels_last.

`auto` converts only where the copies pay (passes/layout.py: pays_off), so these
tests force `conv_layout="channels_last"` on the CPU: the compiled model must
compute what eager computes, hand back outputs with eager's strides, and the
change must really have happened (the compile report's `layout` entry and the
generated wrapper say so). Kernels run for both targets: OpenMP, and Triton
through its interpreter.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import no_fallback, tol
from rewritec import report
from rewritec.kinds.kernels import dense_order
from rewritec.options import Options
from rewritec.runtime.build import cxx
from torch import nn

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TARGETS = [
    pytest.param("openmp", marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
]


# --------------------------------------------------------------------------- models
class ConvBnReLU(nn.Module):
    def __init__(self, c_in: int = 3, c_out: int = 8, bias: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet basic block (identity shortcut)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ConvResidual(nn.Module):
    """A convolution with bias, a residual add and a second output (a view)."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.sigmoid(self.conv(x)) * 2.0 + x
        return y, y.flatten(2)


def _randomize_bn(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
    return m


# --------------------------------------------------------------------------- helpers
def _compile(m: Any, target: str, layout: str = "channels_last") -> Any:
    return torch.compile(m, backend="rewritec", options={
        "strict": True, "target": target, "conv_layout": layout, "freeze": True})


def _layouts() -> list[dict[str, Any]]:
    return [r.layout for r in report.RECORDS]


def _check_eval(m: nn.Module, x: torch.Tensor, target: str,
                layout: str = "channels_last") -> Any:
    """Compiled == eager (values and strides) under no_grad; returns the output."""
    m = _randomize_bn(m).eval()
    compiled = _compile(m, target, layout)
    with no_fallback(("inference",)), torch.no_grad():
        got, want = compiled(x), m(x)
    torch.testing.assert_close(got, want, **tol(x.dtype))
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        assert g.stride() == w.stride(), f"strides {g.stride()} != eager's {w.stride()}"
    return got


def _leaves(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


# --------------------------------------------------------------------------- eval
@pytest.mark.parametrize("target", TARGETS)
def test_conv_bn_relu_eval(target: str) -> None:
    _check_eval(ConvBnReLU(), torch.randn(2, 3, 8, 8), target)
    [layout] = _layouts()
    # the frozen weight is converted once, the input per call, the output restrided
    assert layout == {"conv_layout": "channels_last", "convolutions": 1,
                      "inputs_converted_per_call": 1, "weights_converted_once": 1,
                      "outputs_restrided": 1}
    # the restride is the last kernel's store, not a copy after it, and the input's
    # conversion is a copy kernel (rule fuse-pointwise): only the convolution is ATen's
    assert report.RECORDS[0].fallback_ops == {"convolution": 1}


@pytest.mark.parametrize("target", TARGETS)
def test_resnet_basic_block_eval(target: str) -> None:
    _check_eval(BasicBlock(), torch.randn(2, 8, 6, 6), target)
    [layout] = _layouts()
    # the second convolution reads the first one's NHWC output: no conversion
    assert layout["convolutions"] == 2 and layout["inputs_converted_per_call"] == 1
    assert layout["weights_converted_once"] == 2 and layout["outputs_restrided"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_conv_bias_residual_add(target: str) -> None:
    y, flat = _check_eval(ConvResidual(), torch.randn(2, 4, 5, 6), target)
    assert flat._base is y  # still a view of the first output, as in eager
    [layout] = _layouts()
    assert layout["conv_layout"] == "channels_last" and layout["outputs_restrided"] == 1
    # restored once, at the views' base, by the kernel's store; the input's
    # conversion is a copy kernel (fuse-pointwise): no clone runs on ATen
    assert "clone" not in report.RECORDS[0].fallback_ops
    assert [k["ops"] for k in report.RECORDS[0].kernels].count({"clone": 1}) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_odd_size_three_channels(target: str) -> None:
    _check_eval(ConvBnReLU(c_in=3, c_out=5, bias=True), torch.randn(1, 3, 7, 5), target)
    assert _layouts()[0]["convolutions"] == 1


class ConvSiluConv(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.silu(self.conv1(x)) * 0.5)


@pytest.mark.parametrize("target", TARGETS)
def test_kernel_between_convolutions_runs_in_nhwc(target: str) -> None:
    # The pointwise kernel between the convolutions iterates in NHWC order and
    # writes NHWC, so the second convolution needs no conversion.
    _check_eval(ConvSiluConv(), torch.randn(2, 4, 5, 7), target)
    [layout] = _layouts()
    assert layout["convolutions"] == 2 and layout["inputs_converted_per_call"] == 1
    # the input's conversion (a copy kernel writing NHWC), then the silu in NHWC
    kernels = report.RECORDS[0].kernels[:2]
    assert [(k["rules"], k["order"]) for k in kernels] == [
        (["fuse-pointwise"], (0, 2, 3, 1)), (["fuse-pointwise"], (0, 2, 3, 1))]
    assert kernels[0]["ops"] == {"clone": 1} and "clone" not in kernels[1]["ops"]


@pytest.mark.parametrize("target", TARGETS)
def test_dynamic_shapes(target: str) -> None:
    # Symbolic sizes: strides are expressions, and views with symbolic sizes
    # (generic aten.view) run as reshape over the NHWC values.
    for m in (_randomize_bn(BasicBlock(4)).eval(), ConvResidual(4).eval()):
        torch._dynamo.reset()
        report.reset()
        compiled = torch.compile(m, backend="rewritec", dynamic=True, options={
            "strict": True, "target": target, "conv_layout": "channels_last"})
        with torch.no_grad():
            for n, h in ((2, 5), (3, 6)):
                x = torch.randn(n, 4, h, 7)
                for g, w in zip(_leaves(compiled(x)), _leaves(m(x)), strict=True):
                    torch.testing.assert_close(g, w, **tol(x.dtype))
                    assert g.stride() == w.stride()
        assert {r.layout.get("conv_layout") for r in report.RECORDS} == {"channels_last"}


def test_channels_last_input_needs_no_conversion() -> None:
    # The caller's tensor already is NHWC: eager's output is NHWC too, and kept.
    x = torch.randn(2, 3, 7, 5).contiguous(memory_format=torch.channels_last)
    _check_eval(ConvBnReLU(), x, "openmp" if cxx() else "aten")
    [layout] = _layouts()
    assert "inputs_converted_per_call" not in layout and "outputs_restrided" not in layout


@pytest.mark.parametrize("target", TARGETS)
def test_wrapper_converts_once(target: str, tmp_path: Any) -> None:
    m = _randomize_bn(BasicBlock()).eval()
    compiled = torch.compile(m, backend="rewritec", options={
        "strict": True, "target": target, "conv_layout": "channels_last", "freeze": True,
        "out_dir": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(1, 8, 4, 4))
    source = (tmp_path / f"{report.RECORDS[0].name}.wrapper.py").read_text()
    # one conversion, as a copy kernel (fuse-pointwise), not an ATen clone
    copies = [k["name"] for k in report.RECORDS[0].kernels if k["ops"] == {"clone": 1}]
    calls = [ln for ln in source.splitlines() if "= _k" in ln]
    assert len(copies) == 1 and sum(copies[0] in ln for ln in calls) == 1
    assert "memory_format=torch.channels_last" not in source
    assert source.count("aten.convolution.default") == 2


# --------------------------------------------------------------------------- training
def _same_training_state(m: nn.Module, eager: nn.Module, dtype: torch.dtype) -> None:
    """Every gradient (values and strides) and buffer of `m` equals eager's."""
    for (name, pc), pe in zip(m.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, **tol(dtype), msg=name)
        assert pc.grad.stride() == pe.grad.stride(), name
    for bc, be in zip(m.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(bc, be, **tol(dtype))


@pytest.mark.parametrize("target", TARGETS)
def test_training_forward_backward(target: str) -> None:
    torch.manual_seed(0)
    m = BasicBlock(channels=4).train()
    eager = BasicBlock(channels=4).train()
    eager.load_state_dict(m.state_dict())
    compiled = _compile(m, target)
    x = torch.randn(2, 4, 5, 5)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with no_fallback(("forward", "backward")):
        out_c, out_e = compiled(xc), eager(xe)
        torch.testing.assert_close(out_c, out_e, **tol(x.dtype))
        assert out_c.stride() == out_e.stride()
        grad = torch.randn_like(out_e)
        out_c.backward(grad)
        out_e.backward(grad)
    torch.testing.assert_close(xc.grad, xe.grad, **tol(x.dtype))
    assert xc.grad.stride() == xe.grad.stride()
    _same_training_state(m, eager, x.dtype)
    forward = [r.layout for r in report.RECORDS if r.kind == "forward"]
    assert forward and forward[0]["conv_layout"] == "channels_last"
    # weights are parameters here, not constants: converted on every call
    assert forward[0]["weights_converted_per_call"] == 2
    # the activations the backward reads stay NHWC (frontend/saved_layouts.py)
    assert forward[0]["saved_in_new_layout"] >= 2
    assert forward[0]["outputs_restrided"] == 1  # the block's result, which the caller sees


class SmallCnn(nn.Module):
    """Two convolution blocks, a residual, pooling and a classifier: the backward
    reads saved NHWC activations through batch norm, relu and convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBnReLU(3, 8, bias=True)
        self.block = BasicBlock(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.block(self.stem(x)).mean((2, 3)))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(4, 3, 12, 12), (3, 3, 7, 9)])
def test_training_steps_with_saved_nhwc_activations(target: str, shape: tuple[int, ...]
                                                    ) -> None:
    """Several training steps: loss, every gradient (values and strides) and the
    batch-norm running statistics equal eager's, with the saved activations NHWC."""
    torch.manual_seed(1)
    m, eager = SmallCnn().train(), SmallCnn().train()
    eager.load_state_dict(m.state_dict())
    compiled = _compile(m, target)
    with no_fallback(("forward", "backward")):
        for _ in range(3):
            x = torch.randn(*shape)
            m.zero_grad()
            eager.zero_grad()
            loss_c = compiled(x).square().mean()
            loss_e = eager(x).square().mean()
            torch.testing.assert_close(loss_c, loss_e, **tol(x.dtype))
            loss_c.backward()
            loss_e.backward()
            _same_training_state(m, eager, x.dtype)
    forward = [r.layout for r in report.RECORDS if r.kind == "forward"]
    assert forward[0]["saved_in_new_layout"] >= 3


def test_auto_converts_training_forward_only_when_replayed() -> None:
    """Without CUDA-graph replay a training step is host-bound, and ATen's NHWC
    convolutions cost more host time a call: `auto` leaves that forward alone."""
    from rewritec.passes.layout import relayout_for

    saved = frozenset({1, 2})
    args: Any = (None, None, {})
    assert relayout_for("auto", "forward", *args, free_outputs=saved) is None
    assert relayout_for("auto", "forward", *args, free_outputs=frozenset(), replayed=True) is None
    assert relayout_for("auto", "forward", *args, free_outputs=saved, replayed=True) is not None
    assert relayout_for("auto", "backward", *args, free_outputs=saved, replayed=True) is None
    assert relayout_for("channels_last", "forward", *args) is not None


def test_follow_saved_layouts_propagates_and_restores_results() -> None:
    """A backward graph's inputs arriving NHWC: metadata follows them, and a result
    whose layout changed gets eager's back (an NCHW gradient)."""
    from rewritec.frontend.saved_layouts import follow_saved_layouts
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def bw(saved: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.aten.threshold_backward.default(grad, saved, 0), saved.sum((0, 2, 3))

    mode = FakeTensorMode()
    with mode:
        saved, grad = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    gm = make_fx(bw, tracing_mode="fake")(saved, grad)
    with mode:
        nhwc = saved.contiguous(memory_format=torch.channels_last)
    assert not follow_saved_layouts(gm, [saved, grad])  # nothing differs: untouched
    assert follow_saved_layouts(gm, [nhwc, grad])
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert placeholder.meta["val"].stride() == nhwc.stride()
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert all(o.meta["val"].is_contiguous() for o in outs)
    x = torch.randn(2, 3, 4, 5)
    g = torch.randn(2, 3, 4, 5)
    got = gm(x.contiguous(memory_format=torch.channels_last), g)
    # real example tensors are made fake for the propagation
    again = make_fx(bw, tracing_mode="fake")(saved, grad)
    assert follow_saved_layouts(again, [x.contiguous(memory_format=torch.channels_last), g])
    assert next(n for n in again.graph.nodes if n.op == "placeholder").meta["val"].stride() \
        == nhwc.stride()
    want = bw(x, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
        assert a.stride() == b.stride()


# --------------------------------------------------------------------------- off
def test_option_off_on_cpu() -> None:
    m = _randomize_bn(ConvBnReLU()).eval()
    compiled = _compile(m, "openmp" if cxx() else "aten", "keep")
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
    assert _layouts() == [{}]  # keep: no layout phase


def test_auto_on_cpu_converts_a_lone_convolution() -> None:
    """oneDNN's NCHW convolutions are about 1.6x slower than NHWC ones on the CPU:
    even a lone conv+bn+relu pays for its copies there."""
    _check_eval(ConvBnReLU(), torch.randn(2, 3, 6, 6), "openmp" if cxx() else "aten",
                layout="auto")
    assert _layouts()[0]["conv_layout"] == "channels_last"


class ConvChain(nn.Module):
    def __init__(self, channels: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1)
                                   for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


@pytest.mark.parametrize(("model", "expected"), [(ConvBnReLU, "keep"),
                                                 (BasicBlock, "channels_last"),
                                                 (ConvChain, "channels_last")])
def test_auto_converts_where_it_pays_off(model: type, expected: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Where a copied element costs 3/4 of what an NHWC output element saves (an H200
    # before the copies were tiled kernels), a lone conv pays for its input's
    # conversion and its output's restore without gaining enough; two convolutions gain.
    from rewritec.passes import layout

    monkeypatch.setitem(layout.COPY_COST, "cpu", (3, 4))
    c_in = 3 if model is ConvBnReLU else 4
    _check_eval(model(c_in) if model is ConvBnReLU else model(4), torch.randn(2, c_in, 6, 6),
                "openmp" if cxx() else "aten", layout="auto")
    [record] = _layouts()
    assert record["conv_layout"] == expected
    if expected == "keep":
        assert "cost more than NHWC convolutions save" in record["reason"]


def test_option_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWRITEC_CONV_LAYOUT", "channels_last")
    assert Options.make().conv_layout == "channels_last"
    assert Options.make(conv_layout="keep").conv_layout == "keep"
    monkeypatch.setenv("REWRITEC_CONV_LAYOUT", "nhwc")
    with pytest.raises(Exception, match="conv_layout must be one of"):
        Options.make()


# --------------------------------------------------------------------------- pieces
def test_dense_order() -> None:
    nchw = torch.empty(2, 3, 4, 5)
    nhwc = nchw.contiguous(memory_format=torch.channels_last)
    assert dense_order(nchw.shape, nchw.stride()) == (0, 1, 2, 3)
    assert dense_order(nhwc.shape, nhwc.stride()) == (0, 2, 3, 1)
    assert dense_order((2, 3), nchw[:, :, 0, :2].stride()) is None  # not dense
    for shape in [(2, 3, 1, 1), (1, 3, 1, 4), (2, 1, 4, 4)]:
        for fmt in (torch.contiguous_format, torch.channels_last):
            t = torch.empty(shape, memory_format=fmt)
            order = dense_order(t.shape, t.stride())
            inverse = [order.index(k) for k in range(4)]
            rebuilt = torch.empty([shape[k] for k in order]).permute(inverse)
            assert rebuilt.stride() == t.stride(), (shape, fmt)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4), (0, 3), (3, 0, 2), (1, 1, 7)])
def test_launch_outputs_get_torch_contiguous_strides(shape) -> None:
    from rewritec.runtime.launch import dense_strides, empty_strided

    assert dense_strides(shape) == torch.empty(shape).stride()
    out = empty_strided(shape, dense_strides(shape), torch.float16, torch.device("cpu"))
    assert out.shape == shape and out.is_contiguous() and out.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", [False, True], ids=["f32", "bf16-autocast"])
def test_replayed_training_on_cuda_saves_nhwc_activations(amp: bool) -> None:
    """`auto` under reduce-overhead: the training forward runs its convolutions NHWC
    and saves NHWC activations; each replayed step's loss, gradients (values and
    strides) and running statistics equal eager's."""
    torch.manual_seed(2)
    dev = torch.device("cuda")
    m, eager = SmallCnn().to(dev).train(), SmallCnn().to(dev).train()
    eager.load_state_dict(m.state_dict())
    # mode="reduce-overhead", with strict on (torch.compile takes a mode or options)
    compiled = torch.compile(m, backend="rewritec", options={"strict": True,
                                                             "cudagraphs": "on"})
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # NHWC and NCHW algorithms round alike
    try:
        for step in range(4):
            x = torch.randn(8, 3, 16, 16, device=dev)
            torch.compiler.cudagraph_mark_step_begin()
            m.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss_c = compiled(x).float().square().mean()
                loss_e = eager(x).float().square().mean()
            loss_c.backward()
            loss_e.backward()
            rtol, atol = (2e-2, 2e-2) if amp else (1e-4, 1e-4)
            torch.testing.assert_close(loss_c, loss_e, rtol=rtol, atol=atol)
            # against the largest gradient: a bias before batch norm has a gradient
            # of about zero, all rounding
            scale = max(float(p.grad.abs().max()) for p in eager.parameters())
            for (name, pc), pe in zip(m.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(pc.grad / scale, pe.grad / scale, rtol=rtol,
                                           atol=atol, msg=f"step {step}: {name}")
                assert pc.grad.stride() == pe.grad.stride(), name
            for bc, be in zip(m.buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(bc.float(), be.float(), rtol=rtol, atol=atol)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    forward = [r for r in report.RECORDS if r.kind == "forward"]
    assert forward[0].layout["conv_layout"] == "channels_last"
    assert forward[0].layout["saved_in_new_layout"] >= 3
    assert all(r.status == "compiled" for r in report.RECORDS), \
        [(r.name, r.status, r.reason) for r in report.RECORDS]


@pytest.mark.parametrize("target", TARGETS)
def test_nonfinite_weights_over_zero_padding_follow_the_nhwc_convolution(target: str) -> None:
    """Known divergence (README, Reliability): an inf weight over zero padding is nan
    in ATen's NCHW convolution (inf * 0) and not in its NHWC one, which skips the
    padding; under channels_last rewritec's convolution is the NHWC one, so its result
    is eager's for a channels_last input. Inf and nan inputs with finite weights agree
    with eager's NCHW result."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 5, 4)
    w = torch.randn(9, 1, 3, 2)
    w[0, 0, 0, 0], w[4, 0, 2, 1] = math.inf, -math.inf
    b = torch.randn(9)

    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, b, stride=2, padding=1, groups=3)

    compiled = torch.compile(conv, backend="rewritec", options={
        "strict": True, "target": target, "conv_layout": "channels_last"})
    cl = torch.channels_last
    nhwc = conv(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl), b)
    assert conv(x, w, b).isnan().sum() > nhwc.isnan().sum()  # the two ATen layouts differ
    torch.testing.assert_close(compiled(x, w, b), nhwc.contiguous(), equal_nan=True)
    x[0, 1, 2, 2], x[0, 2, 4, 3] = math.inf, math.nan
    w = torch.randn(9, 1, 3, 2)
    torch.testing.assert_close(compiled(x, w, b), conv(x, w, b), equal_nan=True)
