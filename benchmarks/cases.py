"""The benchmark cases: small functions or modules, each with an input factory.

A `Case` is a name plus a `build(config) -> Instance` factory. The `Instance` holds
what gets compiled (`fn`, a function or an `nn.Module`), the inputs, and what the
harness needs to judge the result: the tolerance for the correctness check and, for
memory-bound cases, the minimal number of bytes read plus written (used for GB/s).

Sizes depend on the device: full size on CUDA (with or without `--quick`), modest sizes
on CPU, small ones for `--quick` on CPU. fp16 cases run in fp16 only on CUDA; on CPU they run a
float32 variant of the same model, and their label says so.

The "engine" case times the rule engine alone (conversion + every phase) on the
captured forward and backward graphs of GPT-2-small blocks; `python -m benchmarks.engine`
reports terms per second against graph size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

T = TypeVar("T")

# Tolerances for the rewritec-vs-eager check.
FP32_POINTWISE = (1e-4, 1e-5)  # (rtol, atol)
FP32_REDUCTION = (1e-4, 1e-4)
FP32_MATMUL = (1e-3, 1e-3)
FP32_TF32 = (5e-3, 5e-3)
FP16 = (2e-2, 2e-2)


class Skip(Exception):
    """Raised by a case factory when the case cannot run here; the message says why."""


@dataclass(frozen=True)
class Config:
    device: torch.device
    quick: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def half(self) -> torch.dtype:
        """fp16 on CUDA; the float32 variant on CPU."""
        return torch.float16 if self.cuda else torch.float32

    def pick(self, *, cuda: T, cpu: T, quick: T) -> T:
        """A size by device, and `quick` for --quick on CPU.

        On CUDA --quick keeps the full sizes: there compiling, not running, takes the time.
        """
        if self.cuda:
            return cuda
        return quick if self.quick else cpu


@dataclass
class Instance:
    fn: Callable[..., Any]  # what gets compiled: a function or an nn.Module
    inputs: tuple[Any, ...]
    shape: str  # human-readable sizes and dtype
    bytes_moved: int | None = None  # minimal bytes read + written, for memory-bound cases
    rtol: float = FP32_POINTWISE[0]
    atol: float = FP32_POINTWISE[1]
    training: bool = False  # fn returns a loss; one step = forward + backward
    params: tuple[torch.Tensor, ...] = ()  # training: whose gradients are reset and compared
    engine: bool = False  # fn is a zero-argument engine run; nothing to compile
    dtype_label: str = ""  # e.g. "fp16" or "fp32"; shown beside the case name
    note: str = ""

    def run(self, fn: Callable[..., Any]) -> Any:
        """One step with `fn` standing in for `self.fn` (eager or compiled)."""
        if self.engine:
            return fn()
        if not self.training:
            return fn(*self.inputs)
        for p in self.params:
            p.grad = None
        loss = fn(*self.inputs)
        loss.backward()
        return (loss.detach(), *(p.grad for p in self.params))


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Callable[[Config], Instance]
    memory_bound: bool = False
    kind: str = "model"  # "model" (eager / inductor / rewritec) or "engine" (rewritec only)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _randn(cfg: Config, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=cfg.device, dtype=dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def _half_note(cfg: Config) -> str:
    return "" if cfg.cuda else "float32 variant on CPU (fp16 cases run in fp16 only on CUDA)"


# --------------------------------------------------------------------------- pointwise


def pointwise_chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a = torch.tanh(x * 0.5 + y) * torch.sigmoid(x)
    return torch.relu(a - 0.25 * y) + x * y


def trig_identity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # sin^2 + cos^2 == 1 sits inside a larger expression: a rewriter can drop it.
    return torch.relu(x * 0.5 + (torch.sin(x) ** 2 + torch.cos(x) ** 2) * y) - y


def gelu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def _two_vectors(fn: Callable[..., torch.Tensor]) -> Callable[[Config], Instance]:
    def build(cfg: Config) -> Instance:
        n = cfg.pick(cuda=1 << 25, cpu=1 << 23, quick=1 << 21)
        x, y = _randn(cfg, n), _randn(cfg, n)
        out = torch.empty_like(x)
        return Instance(fn=fn, inputs=(x, y), shape=f"{n} fp32",
                        bytes_moved=nbytes(x, y, out), dtype_label="fp32")

    return build


def _build_gelu_bias(cfg: Config) -> Instance:
    rows = cfg.pick(cuda=8192, cpu=2048, quick=256)
    width = 4096
    x, b = _randn(cfg, rows, width), _randn(cfg, width)
    return Instance(fn=gelu_bias, inputs=(x, b), shape=f"{rows}x{width} fp32",
                    bytes_moved=nbytes(x, b, x), dtype_label="fp32")


# --------------------------------------------------------------------------- per channel


def channel_sum(x: torch.Tensor) -> torch.Tensor:
    """A batch norm's statistic or a convolution's bias gradient: NCHW summed over N, H, W."""
    return (x * 2.0).sum((0, 2, 3))


def channel_affine(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A batch norm's output in training: a per-channel scale and shift, then ReLU."""
    return torch.relu(x * a.view(1, -1, 1, 1) + b.view(1, -1, 1, 1))


def _per_channel(kind: str) -> Callable[[Config], Instance]:
    def build(cfg: Config) -> Instance:
        n, c, hw = cfg.pick(cuda=(32, 128, 56), cpu=(32, 64, 28), quick=(8, 64, 28))
        x = _randn(cfg, n, c, hw, hw)
        shape = f"{n}x{c}x{hw}x{hw} fp32"
        if kind == "sum":
            return Instance(fn=channel_sum, inputs=(x,), shape=shape, rtol=1e-4, atol=1e-2,
                            bytes_moved=nbytes(x) + c * 4, dtype_label="fp32")
        a, b = _randn(cfg, c), _randn(cfg, c)
        return Instance(fn=channel_affine, inputs=(x, a, b), shape=shape,
                        bytes_moved=2 * nbytes(x) + nbytes(a, b), dtype_label="fp32")

    return build


# --------------------------------------------------------------------------- row reductions


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Written out as in LLaMA-style code, not F.rms_norm.
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * w


def _rows(kind: str, width: int) -> Callable[[Config], Instance]:
    def build(cfg: Config) -> Instance:
        total = cfg.pick(cuda=1 << 25, cpu=1 << 23, quick=1 << 20)
        rows = max(1, total // width)
        x = _randn(cfg, rows, width)
        w, b = _randn(cfg, width), _randn(cfg, width)
        fn: Callable[..., torch.Tensor]
        if kind == "softmax":
            fn, inputs = softmax, (x,)
        elif kind == "layer_norm":
            fn, inputs = layer_norm, (x, w, b)
        else:
            fn, inputs = rms_norm, (x, w)
        rtol, atol = FP32_REDUCTION
        return Instance(fn=fn, inputs=inputs, shape=f"{rows}x{width} fp32",
                        bytes_moved=nbytes(*inputs, x), rtol=rtol, atol=atol, dtype_label="fp32")

    return build


# --------------------------------------------------------------------------- modules


class ConvBnReLU(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet basic block (identity shortcut)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class MLP(nn.Module):
    """Linear - GELU - Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GPT2Block(nn.Module):
    """GPT-2 transformer block (pre-LN, causal attention written out, tanh-GELU MLP)."""

    def __init__(self, dim: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.attn_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TrainLoss(nn.Module):
    """MSE loss of a model: what the training-step case compiles."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), target)


def _randomize_bn(module: nn.Module) -> None:
    """Non-trivial running statistics and affine parameters, so BN folding matters."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


def _conv_module(make: Callable[[int], nn.Module]) -> Callable[[Config], Instance]:
    def build(cfg: Config) -> Instance:
        n = cfg.pick(cuda=32, cpu=8, quick=2)
        c, hw = 64, 56
        model = make(c)
        _randomize_bn(model)
        model = model.to(cfg.device).eval()
        x = _randn(cfg, n, c, hw, hw)
        rtol, atol = FP32_MATMUL
        note = None
        if cfg.cuda and torch.backends.cudnn.allow_tf32:
            # cuDNN convolves fp32 in TF32 (10-bit mantissa) by default; rewritec folds
            # batch norm into the weights, so the two round differently at ~1e-3.
            rtol, atol = FP32_TF32
            note = "TF32 convolutions (cudnn.allow_tf32): compared at rtol=atol=5e-3"
        return Instance(fn=model, inputs=(x,), shape=f"N={n} C={c} {hw}x{hw} fp32",
                        rtol=rtol, atol=atol, dtype_label="fp32", note=note)

    return build


def _build_mlp(cfg: Config) -> Instance:
    tokens, dim = cfg.pick(cuda=(8192, 1024), cpu=(512, 512), quick=(128, 256))
    dtype = cfg.half
    model = MLP(dim, 4 * dim).to(cfg.device, dtype).eval()
    x = _randn(cfg, tokens, dim, dtype=dtype)
    rtol, atol = FP16 if dtype == torch.float16 else FP32_MATMUL
    name = _dtype_name(dtype)
    return Instance(fn=model, inputs=(x,), shape=f"{tokens}x{dim}->{4 * dim}->{dim} {name}",
                    rtol=rtol, atol=atol, dtype_label=name, note=_half_note(cfg))


def _build_gpt2(cfg: Config) -> Instance:
    batch, seq, dim, heads = cfg.pick(cuda=(8, 1024, 768, 12), cpu=(1, 256, 384, 6),
                                      quick=(1, 128, 256, 4))
    dtype = cfg.half
    model = GPT2Block(dim, heads, seq).to(cfg.device, dtype).eval()
    x = _randn(cfg, batch, seq, dim, dtype=dtype)
    rtol, atol = FP16 if dtype == torch.float16 else FP32_MATMUL
    name = _dtype_name(dtype)
    return Instance(fn=model, inputs=(x,), shape=f"B={batch} T={seq} d={dim} h={heads} {name}",
                    rtol=rtol, atol=atol, dtype_label=name, note=_half_note(cfg))


def _build_mlp_train(cfg: Config) -> Instance:
    tokens, dim = cfg.pick(cuda=(8192, 1024), cpu=(512, 256), quick=(128, 128))
    model = MLP(dim, 4 * dim).to(cfg.device).train()
    x, target = _randn(cfg, tokens, dim), _randn(cfg, tokens, dim)
    return Instance(fn=TrainLoss(model), inputs=(x, target), training=True,
                    params=tuple(model.parameters()),
                    shape=f"{tokens}x{dim}->{4 * dim}->{dim} fp32 fwd+bwd",
                    rtol=1e-3, atol=1e-5, dtype_label="fp32")


# --------------------------------------------------------------------------- engine


def _build_engine(cfg: Config) -> Instance:
    # Lazy import: the harness must load even while rewritec is broken or partial.
    from .engine import engine_step

    blocks = 2 if cfg.quick else 12
    return Instance(fn=engine_step(blocks), inputs=(), engine=True,
                    shape=f"fw+bw ATen graphs of {blocks} GPT-2-small blocks")


# --------------------------------------------------------------------------- registry


CASES: tuple[Case, ...] = (
    Case("pointwise_chain", "tanh/sigmoid/relu chain over two vectors",
         _two_vectors(pointwise_chain), memory_bound=True),
    Case("trig_identity", "sin(x)**2 + cos(x)**2 inside a larger expression",
         _two_vectors(trig_identity), memory_bound=True),
    Case("gelu_bias", "gelu(x + b), b broadcast over rows", _build_gelu_bias, memory_bound=True),
    *(Case(f"{kind}_{label}", f"{kind} over rows of width {width}", _rows(kind, width),
           memory_bound=True)
      for kind in ("softmax", "layer_norm", "rms_norm")
      for label, width in (("1k", 1024), ("4k", 4096), ("32k", 32768))),
    Case("channel_sum", "NCHW summed over N, H and W (batch norm statistics)",
         _per_channel("sum"), memory_bound=True),
    Case("channel_affine", "relu(x * a[c] + b[c]) over NCHW (batch norm's output)",
         _per_channel("affine"), memory_bound=True),
    Case("conv_bn_relu", "Conv2d 3x3 + BatchNorm2d + ReLU, eval", _conv_module(ConvBnReLU)),
    Case("mlp", "Linear-GELU-Linear inference (fp16 on CUDA)", _build_mlp),
    Case("gpt2_block", "GPT-2 block inference (fp16 on CUDA)", _build_gpt2),
    Case("resnet_block", "ResNet basic block, eval", _conv_module(BasicBlock)),
    Case("mlp_train", "MLP training step: forward + backward of an MSE loss", _build_mlp_train),
    Case("engine", "rule engine alone on a large term graph", _build_engine, kind="engine"),
)

BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
