"""Wrong answers found outside the project's own tests (HF models on the CPU, other
dtypes, integer inputs, weight updates through `.data`), each a minimized test
that failed before its fix. Every check is differential: the compiled program
against eager on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def compiled(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="rewritec", options={"strict": True, **options})


# --------------------------------------------------------------------------- SDPA on the CPU
# Core ATen decomposed `_scaled_dot_product_flash_attention_for_cpu` into the math
# attention, whose second output (the weights) the backward read as the logsumexp:
# |dL/dq| came out 55.84 against eager's 11.86. Under autocast the backward crashed.
@pytest.mark.parametrize("shape", [(1, 1, 4, 8), (2, 3, 5, 16), (1, 4, 33, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_gradients_equal_eager(shape, causal) -> None:
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal) ** 2).sum()

    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(f)(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_sdpa_with_a_mask_on_transposed_inputs() -> None:
    q, k, v = (torch.randn(2, 6, 3, 8).transpose(1, 2).requires_grad_() for _ in range(3))
    mask = torch.randn(6, 6) > 0

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin().sum()

    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(f)(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transformer_layer_trains_under_cpu_autocast(dtype) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    x = torch.randn(2, 5, 16)

    def step(model):
        model.zero_grad()
        with torch.autocast("cpu", dtype):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want_loss, want = step(layer)
    got_loss, got = step(compiled(layer))
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got_loss, want_loss, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
