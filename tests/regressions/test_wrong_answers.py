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
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_sdpa_with_a_mask_on_transposed_inputs() -> None:
    q, k, v = (torch.randn(2, 6, 3, 8).transpose(1, 2).requires_grad_() for _ in range(3))
    mask = torch.randn(6, 6) > 0

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin().sum()

    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(f)(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
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
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)


# --------------------------------------------------------------------------- rules and dtypes
# Each program below was rewritten by a built-in rule that holds over the reals but
# not on these values: relu(abs(x)) -> abs(x) at int8 -128, 2*sigmoid(2x) - 1 ->
# tanh(x) where 2 * x wraps, x + 0.0 -> x at -0.0, 1 - sigmoid(x) -> sigmoid(-x)
# where sigmoid rounds to 1. `rules check` now probes each rule on these values.
def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the kernels' rounding, with nan, infinities and signed zeros equal."""
    torch.testing.assert_close(got, want, equal_nan=True)
    if want.is_floating_point():
        zeros = (want == 0) & (got == 0)
        assert torch.equal(got.signbit()[zeros], want.signbit()[zeros])


INT_EXTREMES = {
    torch.int8: [-128, -1, 0, 1, 127],
    torch.int32: [-2 ** 31, 2 ** 30, -2 ** 30, 0, 5],
    torch.int64: [-2 ** 63, 2 ** 62, 0, -7, 3],
}


@pytest.mark.parametrize("dtype", list(INT_EXTREMES), ids=str)
@pytest.mark.parametrize("fn", [
    lambda x: torch.relu(torch.abs(x)),
    lambda x: 2 * torch.sigmoid(2 * x) - 1,
    lambda x: torch.tanh(-x),
    lambda x: 1 - torch.sigmoid(x),
    lambda x: (x + 0) * 3,
], ids=["relu-abs", "sigmoid-to-tanh", "tanh-neg", "one-minus-sigmoid", "add-zero"])
def test_integer_extremes_equal_eager(fn, dtype) -> None:
    x = torch.tensor(INT_EXTREMES[dtype], dtype=dtype)
    with torch.no_grad():
        _same(compiled(fn)(x), fn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [
    lambda x: 1 / (x + 0.0),
    lambda x: 1 / (x + 0),
    lambda x: torch.log(1 - torch.sigmoid(x)),
    lambda x: 2 * torch.sigmoid(2 * x) - 1,
    lambda x: 1 / torch.exp(torch.log(torch.relu(x))),
], ids=["add-zero-float", "add-zero", "one-minus-sigmoid", "sigmoid-to-tanh", "exp-log"])
def test_float_specials_equal_eager(fn, dtype) -> None:
    x = torch.tensor([-0.0, 0.0, 0.005, -0.005, 20.0, 40.0, -20.0, float("inf"),
                      float("-inf"), float("nan"), 1.0], dtype=dtype)
    with torch.no_grad():
        _same(compiled(fn)(x), fn(x))


def test_fast_math_still_applies_the_inexact_rules() -> None:
    from rewritec import report

    x = torch.randn(16)
    with torch.no_grad():
        got = compiled(lambda x: torch.log(1 - torch.sigmoid(x)), fast_math=True)(x)
    torch.testing.assert_close(got, torch.log(1 - torch.sigmoid(x)))
    assert any(r.rules_fired.get("one-minus-sigmoid") for r in report.RECORDS)


# --------------------------------------------------------------------------- the user-rule gate
# A user rule used to run only its own examples at compile time: `x / x -> 1` with a
# four-element example turned eager's nan at 0 into 1.
def test_a_user_rule_gets_the_probe_before_use(tmp_path) -> None:
    import warnings

    import rewritec
    from rewritec.compiler import RewritecWarning

    rule = tmp_path / "div.yaml"
    rule.write_text('kind: simplify\nrules:\n  - name: div-self\n    doc: "x / x -> 1"\n'
                    '    pattern: x / x\n    replace: ones_like(x)\n    examples: [{x: 4xf32}]\n')
    x = torch.tensor([0.0, 1.0, 2.0, float("nan")])
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = rewritec.compile(lambda x: (x / x).sin(), rules=[str(rule)])(x)
    torch.testing.assert_close(got, (x / x).sin(), equal_nan=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, RewritecWarning)]
    assert any("got 1.0, eager nan" in m for m in messages), messages
