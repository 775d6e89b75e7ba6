"""A layer norm over a half input with f32 weights (what CPU autocast leaves: a
bf16 GELU output into nn.LayerNorm), trained through rewritec against eager.

Eager's layer_norm returns its mean and rstd in f32 for such mixed dtypes, and its
backward requires them so; the traced graph (FakeTensor's shapes and dtypes) gives
them in the input's dtype, so the compiled forward saved them in bf16 and ATen's
backward refused them ("expected scalar type Float but found BFloat16").

The forward's normalized output is rules/decompose/norms.yaml's layer-norm-half
(f32 weights allowed: ATen's mixed-type layer norm computes in f32 and rounds once),
so no native_layer_norm runs in ATen."""

from __future__ import annotations

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops
from rewritec import report

DEVICE, TARGETS = kernel_targets()


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(torch.nn.functional.gelu(self.fc(x)))


def _step(model: torch.nn.Module, fn, x: torch.Tensor, autocast: bool
          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "mixed-by-hand"])
@pytest.mark.parametrize("shape", [(4, 16, 64), (3, 130)], ids=str)
def test_training_a_layer_norm_on_a_half_input_matches_eager(autocast: bool, shape) -> None:
    torch.manual_seed(0)
    width = shape[-1]
    model, ref = Block(width), Block(width)
    ref.load_state_dict(model.state_dict())
    if not autocast:  # a half input and f32 weights without autocast
        for m in (model, ref):
            m.fc.to(torch.bfloat16)
    torch._dynamo.reset()
    report.reset()
    compiled = torch.compile(model, backend="rewritec")
    for _ in range(2):
        x = torch.randn(*shape).to(torch.float32 if autocast else torch.bfloat16)
        got, grads = _step(model, compiled, x, autocast)
        want, ref_grads = _step(ref, ref, x, autocast)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for g, r in zip(grads, ref_grads, strict=True):
            assert g.dtype == r.dtype
            torch.testing.assert_close(g, r, rtol=3e-2, atol=3e-2)
    assert "native_layer_norm" not in outside_ops()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("affine", ["weight-and-bias", "weight-only"])
def test_f32_weights_under_a_half_input_run_in_kernels(target, dtype, affine) -> None:
    """A half model whose norms keep f32 weights: ATen's mixed-type layer norm (on the
    CPU: CUDA's layer norm refuses such weights, and the compiled graph with it)."""
    if target == "openmp" and dtype == torch.float16:
        pytest.skip("f16 arithmetic stays ATen's on the CPU (tests/test_cpu_halves.py)")
    torch.manual_seed(1)
    ln = torch.nn.LayerNorm(48, bias=affine == "weight-and-bias").to(DEVICE)
    torch.nn.init.normal_(ln.weight)
    x = torch.randn(5, 7, 48, device=DEVICE).to(dtype)
    report.reset()
    torch._dynamo.reset()
    compiled = torch.compile(ln, backend="rewritec", options={"target": target, "strict": True})
    if DEVICE == "cuda":
        with pytest.raises(RuntimeError):
            ln(x)
        with pytest.raises(RuntimeError):
            compiled(x)
        return
    got = compiled(x)
    want = ln(x)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert "native_layer_norm" not in outside_ops() and "layer_norm" not in outside_ops()
