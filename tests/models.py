"""Small models and the differential-testing helpers the tests share.

The one rule of the suite: whatever rewritec does to a graph, the compiled
model must compute what eager PyTorch computes - outputs, gradients of inputs
and parameters, and buffer updates (BatchNorm running statistics).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import rewritec
import torch
import torch.nn.functional as F
from rewritec import report
from rewritec.compiler import RewritecWarning
from torch import nn

# Compiled and eager run the same dtype; rewriting and fused kernels may
# reassociate sums, so float32 gets a little room, float64 almost none.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-7, "atol": 1e-7},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES[dtype]


def kernel_targets() -> tuple[str, list[str]]:
    """The device the kernel tests run on and the targets they compile for: OpenMP
    on a CPU machine with a compiler, Triton on a GPU or under the interpreter."""
    import os

    from rewritec.runtime.build import cxx

    cuda = torch.cuda.is_available()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    targets = (["openmp"] if cxx() and not cuda else []) + (
        ["triton"] if cuda or interpreted else [])
    return ("cuda" if cuda else "cpu"), targets


def outside_ops() -> Counter[str]:
    """The ATen ops left outside kernels in every graph `report` recorded, counted."""
    return sum((Counter(rec.fallback_ops) for rec in report.RECORDS), Counter())


def rules_fired() -> Counter[str]:
    """The rules that fired in every graph `report` recorded, counted."""
    return sum((Counter(rec.rules_fired) for rec in report.RECORDS), Counter())


# --------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h  # a residual, so h has two users
        return self.fc3(h)


class SmallCNN(nn.Module):
    """conv+bn+relu twice, then pool and a linear head."""

    def __init__(self, c_in: int = 3, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, max_len: int) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, max_len, max_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPT2Block(nn.Module):
    """Pre-LayerNorm GPT-2 block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d_model: int = 32, n_head: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, max_len)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.c_proj(h)


class ParamArith(nn.Module):
    """Computes on its parameters alone (w * 0.5, exp(b)): what parameter
    freezing folds into new constants in an inference graph."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))
        self.b = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * 0.5).t() + torch.exp(self.b)


# --------------------------------------------------------------------------- compiling
def compile_strict(model: Any, **kw: Any) -> Any:
    return rewritec.compile(model, strict=True, **kw)


def compile_torch_backend(model: Any, **kw: Any) -> Any:
    # The backend by name only: resolved through the torch_dynamo_backends entry point.
    return torch.compile(model, backend="rewritec", **kw)


def compile_torch_backend_strict(model: Any, **kw: Any) -> Any:
    return torch.compile(model, backend="rewritec", options={"strict": True}, **kw)


COMPILERS: dict[str, Callable[..., Any]] = {
    "rewritec.compile(strict=True)": compile_strict,
    "torch.compile(backend='rewritec')": compile_torch_backend,
    "torch.compile(backend='rewritec', options={'strict': True})": compile_torch_backend_strict,
}


@contextlib.contextmanager
def no_fallback(kinds: Sequence[str] = ()) -> Iterator[None]:
    """Fail unless every graph compiled in the block went through rewritec.

    Non-strict compilation falls back silently except for a RewritecWarning,
    so this checks both the warnings and the report; `kinds` lists graph kinds
    (forward, backward, inference) that must have been compiled.
    """
    start = len(report.RECORDS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RewritecWarning)
        yield
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, RewritecWarning)]
    assert not fallbacks, f"rewritec fell back: {fallbacks}"
    records = report.RECORDS[start:]
    assert records, "no graph reached the rewritec backend"
    bad = [(r.name, r.reason) for r in records if r.status != "compiled"]
    assert not bad, f"graphs not compiled by rewritec: {bad}"
    seen = {r.kind for r in records}
    missing = set(kinds) - seen
    assert not missing, f"expected {sorted(missing)} graphs, compiled only {sorted(seen)}"


# --------------------------------------------------------------------------- comparing
def _flat(out: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _leaf_copy(x: Any, requires_grad: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().clone()
    return y.requires_grad_(requires_grad and y.is_floating_point())


def cotangents(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random output gradients (a plain .sum() would make softmax's gradient 0)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            for o in outputs]


def backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
             if o.requires_grad and o.is_floating_point()]
    assert pairs, "no output requires grad"
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def assert_same_state(compiled: nn.Module, eager: nn.Module, **tols: float) -> None:
    """Parameter gradients and buffers (e.g. BatchNorm running stats) agree."""
    cp, ep = dict(compiled.named_parameters()), dict(eager.named_parameters())
    assert cp.keys() == ep.keys()
    for name, pc in cp.items():
        gc, ge = pc.grad, ep[name].grad
        assert (gc is None) == (ge is None), f"grad of {name}: {gc is None=} {ge is None=}"
        if ge is not None:
            torch.testing.assert_close(gc, ge, **tols, msg=lambda m, n=name: f"grad {n}: {m}")
    cb, eb = dict(compiled.named_buffers()), dict(eager.named_buffers())
    assert cb.keys() == eb.keys()
    for name, bc in cb.items():
        torch.testing.assert_close(bc, eb[name], **tols,
                                   msg=lambda m, n=name: f"buffer {n}: {m}")


def perturb_parameters(*models: nn.Module, seed: int) -> None:
    """Apply the same in-place update to every model's parameters (an optimizer
    step) and floating-point buffers (as if someone reloaded BatchNorm stats)."""
    gen = torch.Generator().manual_seed(seed)
    names = [n for n, _ in models[0].named_parameters()]
    deltas = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05
              for n, p in models[0].named_parameters()}
    # Buffers only grow, so running variances stay positive.
    bumps = {n: torch.rand(b.shape, generator=gen, dtype=torch.float64) * 0.05
             for n, b in models[0].named_buffers() if b.is_floating_point()}
    with torch.no_grad():
        for m in models:
            params = dict(m.named_parameters())
            assert list(params) == names
            for n, p in params.items():
                p.add_(deltas[n].to(p.dtype))
                p.grad = None
            buffers = dict(m.named_buffers())
            for n, bump in bumps.items():
                buffers[n].add_(bump.to(buffers[n].dtype))


def check_module(model: nn.Module, inputs: Sequence[Any], compile_fn: Callable[..., Any], *,
                 grad: bool = True, no_grad: bool = False, steps: int = 2,
                 kinds: Sequence[str] | None = None, **tols: float) -> None:
    """Compile `model` and compare it with an eager deep copy for `steps` calls.

    Between calls, both models get the same parameter update, so a compiled
    graph that baked in stale parameters is caught.
    """
    dtype = next(model.parameters()).dtype
    tols = tols or tol(dtype)
    eager = copy.deepcopy(model)
    compiled = compile_fn(model)
    if kinds is None:
        kinds = ("inference",) if no_grad or not grad else ("forward", "backward")
    with no_fallback(kinds):
        for step in range(steps):
            xs_c = [_leaf_copy(x, grad and not no_grad) for x in inputs]
            xs_e = [_leaf_copy(x, grad and not no_grad) for x in inputs]
            ctx = torch.no_grad() if no_grad else contextlib.nullcontext()
            with ctx:
                out_c, out_e = compiled(*xs_c), eager(*xs_e)
            torch.testing.assert_close(out_c, out_e, **tols,
                                       msg=lambda m, s=step: f"output, step {s}: {m}")
            if grad and not no_grad:
                flat_c, flat_e = _flat(out_c), _flat(out_e)
                gs = cotangents(flat_e, seed=step)
                backward(flat_c, gs)
                backward(flat_e, gs)
                for i, (xc, xe) in enumerate(zip(xs_c, xs_e, strict=True)):
                    if isinstance(xe, torch.Tensor) and xe.requires_grad:
                        torch.testing.assert_close(
                            xc.grad, xe.grad, **tols,
                            msg=lambda m, i=i, s=step: f"grad of input {i}, step {s}: {m}")
            assert_same_state(model, eager, **tols)
            perturb_parameters(model, eager, seed=100 + step)


def check_function(fn: Callable[..., Any], make_inputs: Callable[[], list[Any]],
                   compile_fn: Callable[..., Any] = compile_strict, *, grad: bool = True,
                   kinds: Sequence[str] | None = None, **tols: float) -> None:
    """Compare compiled and eager `fn` on inputs built twice by `make_inputs`.

    `make_inputs` returns leaf tensors first (those get gradients) and may
    build non-contiguous views of them: `make_inputs() -> [leaves, args]`.
    """
    leaves_c, args_c = make_inputs()
    leaves_e, args_e = make_inputs()
    dtype = next(x.dtype for x in leaves_e if isinstance(x, torch.Tensor))
    tols = tols or tol(dtype)
    compiled = compile_fn(fn)
    if kinds is None:
        kinds = ("forward", "backward") if grad else ("inference",)
    with no_fallback(kinds):
        out_c, out_e = compiled(*args_c), fn(*args_e)
        torch.testing.assert_close(out_c, out_e, **tols)
        if grad:
            flat_c, flat_e = _flat(out_c), _flat(out_e)
            gs = cotangents(flat_e, seed=0)
            backward(flat_c, gs)
            backward(flat_e, gs)
            for i, (lc, le) in enumerate(zip(leaves_c, leaves_e, strict=True)):
                assert le.grad is not None and lc.grad is not None, f"leaf {i} got no grad"
                torch.testing.assert_close(lc.grad, le.grad, **tols,
                                           msg=lambda m, i=i: f"grad of leaf {i}: {m}")


# ------------------------------------------------------- one op on both kernel targets
def target_params() -> list[Any]:
    """The two kernel targets as pytest parameters: Triton (on a GPU, or under the
    interpreter) and OpenMP (where a C++ compiler is)."""
    import pytest
    from rewritec.runtime.build import cxx

    return [pytest.param("triton", id="triton"),
            pytest.param("openmp", id="openmp",
                         marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler"))]


def target_device(target: str) -> str:
    return "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"


def with_values(shape: tuple[int, ...], dtype: torch.dtype, values: Sequence[float],
                scale: float = 3.0) -> torch.Tensor:
    """randn(shape) * scale with `values` (nan, infinities, signed zeros, ...) as its
    first elements, in `dtype`, on the CPU."""
    x = torch.randn(*shape) * scale
    x.view(-1)[: len(values)] = torch.tensor(values)
    return x.to(dtype)


def check_grad(fn: Callable[..., torch.Tensor], x: torch.Tensor, target: str,
               *others: torch.Tensor, **tols: float) -> None:
    """`fn(x, *others)` compiled strictly for `target` against eager: its value and the
    gradient of x (under a random cotangent where the value is not a scalar)."""
    xc, xe = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(xc, *others)
    want = fn(xe, *others)
    cotangent = torch.randn_like(want) if want.dim() else None
    got.backward(cotangent)
    want.backward(cotangent)
    torch.testing.assert_close(got, want, **tols)
    torch.testing.assert_close(xc.grad, xe.grad, **tols)


def check_block_under_autocast(make: Callable[[], nn.Module], x: torch.Tensor) -> None:
    """A block built twice with one set of weights: a training step of each under CPU
    bf16 autocast, through torch.compile(backend="rewritec", strict) and eagerly;
    losses and gradients equal within bf16's rounding. `report` keeps the records."""
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rewritec", options={"strict": True})
    losses = []
    for m in (compiled, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)
