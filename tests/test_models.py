"""Differential tests: compiled by rewritec == eager PyTorch.

Outputs, gradients of inputs and of parameters, and buffer updates are
compared on an MLP, a conv+bn+relu CNN (train, eval, eval under no_grad), a
GPT-2 block, the layer_norm/softmax family on assorted layouts and dtypes,
and with dynamic shapes. Every compilation is strict (or checked for
fallbacks), so a test fails if rewritec quietly hands a graph back to eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from rewritec import report
from models import (
    COMPILERS,
    MLP,
    GPT2Block,
    ParamArith,
    SmallCNN,
    assert_same_state,
    backward,
    check_function,
    check_module,
    compile_strict,
    cotangents,
    no_fallback,
    tol,
)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------- MLP
@pytest.mark.parametrize("compiler", list(COMPILERS), ids=["rewritec", "torch-backend",
                                                          "torch-backend-strict"])
def test_mlp_train(compiler: str) -> None:
    check_module(MLP().train(), [_randn(5, 16)], COMPILERS[compiler])


def test_mlp_inference_no_grad() -> None:
    # Inference graphs may fold parameters; the parameter update between the
    # two calls must still be seen.
    check_module(MLP().eval(), [_randn(5, 16)], compile_strict, no_grad=True)


def test_folded_parameters_follow_updates() -> None:
    # Folding w * 0.5 and exp(b) at compile time is only sound while w and b
    # stay unchanged; each step updates them in place, and the results must follow.
    check_module(ParamArith().eval(), [_randn(3, 8)], compile_strict, no_grad=True, steps=3)
    check_module(ParamArith().train(), [_randn(3, 8)], compile_strict, steps=2)


def test_mlp_float64() -> None:
    check_module(MLP().double(), [_randn(4, 16, dtype=torch.float64)], compile_strict)


# --------------------------------------------------------------------------- CNN
def test_cnn_train() -> None:
    # Train mode: batch statistics, and running stats updated in place (buffers compared).
    check_module(SmallCNN().train(), [_randn(4, 3, 8, 8)], compile_strict)


def test_batch_norm_backward_stays_one_call_on_the_cpu() -> None:
    # native_batch_norm_backward is an op-table op (never core ATen's decomposition, ten-odd
    # small calls per batch norm). Its rules (rules/decompose/norms.yaml) are
    # more_launches ones, applied only to Triton kernels replayed as CUDA graphs
    # (tests/test_batch_norm_training.py): on the CPU it is one ATen call per batch norm
    start = len(report.RECORDS)
    check_module(SmallCNN().train(), [_randn(4, 3, 8, 8)], compile_strict)
    backward = [r for r in report.RECORDS[start:] if r.kind == "backward"]
    assert backward and sum(r.fallback_ops.get("native_batch_norm_backward", 0)
                            for r in backward) == 2
    assert not any(r.rules_fired.get("batch-norm-backward-input") for r in backward)
    assert not any(r.fallback_ops.get("unsqueeze") for r in backward)


def test_cnn_eval() -> None:
    # Eval mode with autograd on: running stats used, gradients still flow.
    model = SmallCNN()
    _warm_up_batchnorm(model)
    check_module(model.eval(), [_randn(4, 3, 8, 8)], compile_strict)


def test_cnn_eval_no_grad() -> None:
    model = SmallCNN()
    _warm_up_batchnorm(model)
    check_module(model.eval(), [_randn(4, 3, 8, 8)], compile_strict, no_grad=True)


def _warm_up_batchnorm(model: torch.nn.Module) -> None:
    """Give BatchNorm non-trivial running statistics (not just 0 and 1)."""
    model.train()
    with torch.no_grad():
        for seed in range(3):
            model(_randn(8, 3, 8, 8, seed=50 + seed) * 2 + 0.5)


# --------------------------------------------------------------------------- GPT-2 block
def test_gpt2_block_train() -> None:
    check_module(GPT2Block().train(), [_randn(2, 8, 32)], compile_strict)


def test_gpt2_block_float64() -> None:
    check_module(GPT2Block().double(), [_randn(2, 8, 32, dtype=torch.float64)],
                 compile_strict)


def test_gpt2_block_inference_no_grad() -> None:
    check_module(GPT2Block().eval(), [_randn(2, 8, 32)], compile_strict, no_grad=True)


def test_gpt2_block_torch_backend_strict() -> None:
    check_module(GPT2Block(), [_randn(2, 8, 32)],
                 COMPILERS["torch.compile(backend='rewritec', options={'strict': True})"])


# --------------------------------------------------------------------------- dynamic shapes
def _check_dynamic(model: torch.nn.Module, inputs: list[torch.Tensor]) -> None:
    eager = copy.deepcopy(model)
    compiled = compile_strict(model, dynamic=True)
    t = tol(torch.float32)
    with no_fallback(("forward", "backward")):
        for i, x in enumerate(inputs):
            xc = x.clone().requires_grad_(True)
            xe = x.clone().requires_grad_(True)
            out_c, out_e = compiled(xc), eager(xe)
            assert out_c.shape == out_e.shape
            torch.testing.assert_close(out_c, out_e, **t, msg=lambda m, s=x.shape: f"{s}: {m}")
            gs = cotangents([out_e], seed=i)
            backward([out_c], gs)
            backward([out_e], gs)
            torch.testing.assert_close(xc.grad, xe.grad, **t)
            assert_same_state(model, eager, **t)
            for m in (model, eager):
                m.zero_grad(set_to_none=True)


def test_dynamic_batch_mlp() -> None:
    _check_dynamic(MLP(), [_randn(b, 16, seed=b) for b in (3, 7, 12)])


def test_dynamic_batch_and_length_gpt2_block() -> None:
    # A symbolic sequence length also slices the causal mask buffer.
    _check_dynamic(GPT2Block(), [_randn(b, t, 32, seed=b) for b, t in ((2, 5), (3, 9), (4, 12))])


# --------------------------------------------------------------------------- layer_norm / softmax
# Layouts: how the (rows x 16) operand is laid out in memory. Each builds a
# leaf tensor (which receives the gradient) and the view the function sees.
def _contiguous_2d(dtype):
    base = _randn(6, 16, dtype=dtype)
    return base, lambda b: b


def _contiguous_3d(dtype):
    base = _randn(2, 5, 16, dtype=dtype)
    return base, lambda b: b


def _transposed(dtype):
    base = _randn(16, 6, dtype=dtype)
    return base, lambda b: b.t()


def _sliced(dtype):
    base = _randn(7, 40, dtype=dtype)
    return base, lambda b: b[1:, 3:35:2]  # storage offset and stride 2


def _permuted_3d(dtype):
    base = _randn(16, 5, 2, dtype=dtype)
    return base, lambda b: b.permute(2, 1, 0)


def _broadcast(dtype):
    base = _randn(16, dtype=dtype)
    return base, lambda b: b.expand(6, 16)  # stride 0 rows


LAYOUTS = {
    "contiguous-2d": _contiguous_2d,
    "contiguous-3d": _contiguous_3d,
    "transposed": _transposed,
    "sliced": _sliced,
    "permuted-3d": _permuted_3d,
    "broadcast": _broadcast,
}
DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16}
# bfloat16 on a subset of layouts: enough to cover the dtype, cheaper to run.
BF16_LAYOUTS = ("contiguous-2d", "transposed", "sliced")


def _cases():
    for dname, dtype in DTYPES.items():
        for lname in LAYOUTS:
            if dtype is torch.bfloat16 and lname not in BF16_LAYOUTS:
                continue
            yield pytest.param(lname, dtype, id=f"{lname}-{dname}")


def _make_inputs(layout: str, dtype: torch.dtype, *extra_shapes: tuple[int, ...]):
    def make():
        base, view = LAYOUTS[layout](dtype)
        base.requires_grad_(True)
        extras = [_randn(*s, dtype=dtype, seed=7 + i).requires_grad_(True)
                  for i, s in enumerate(extra_shapes)]
        x = view(base)
        return [base, *extras], [x, *extras]

    probe = make()[1][0]
    if layout not in ("contiguous-2d", "contiguous-3d"):
        assert not probe.is_contiguous(), f"layout {layout} should be non-contiguous"
    return make


@pytest.mark.parametrize(("layout", "dtype"), list(_cases()))
@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax(layout: str, dtype: torch.dtype, dim: int) -> None:
    check_function(lambda x: F.softmax(x, dim=dim), _make_inputs(layout, dtype))


@pytest.mark.parametrize(("layout", "dtype"), list(_cases()))
@pytest.mark.parametrize("dim", [-1, 0])
def test_log_softmax(layout: str, dtype: torch.dtype, dim: int) -> None:
    check_function(lambda x: F.log_softmax(x, dim=dim), _make_inputs(layout, dtype))


@pytest.mark.parametrize(("layout", "dtype"), list(_cases()))
def test_layer_norm_affine(layout: str, dtype: torch.dtype) -> None:
    # Weight and bias are leaves too: their gradients are compared.
    check_function(lambda x, w, b: F.layer_norm(x, (16,), w, b, eps=1e-5),
                   _make_inputs(layout, dtype, (16,), (16,)))


@pytest.mark.parametrize(("layout", "dtype"), list(_cases()))
def test_layer_norm_plain(layout: str, dtype: torch.dtype) -> None:
    check_function(lambda x: F.layer_norm(x, (16,)), _make_inputs(layout, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_layer_norm_over_two_dims(dtype: torch.dtype) -> None:
    check_function(lambda x, w: F.layer_norm(x, (5, 16), w, None, eps=1e-6),
                   _make_inputs("permuted-3d", dtype, (5, 16)))


def test_softmax_with_masked_entries() -> None:
    # -inf entries (a causal mask) must give exact zeros and finite gradients.
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)

    def fn(x):
        return F.softmax(x.masked_fill(mask, float("-inf")), dim=-1)

    def make():
        x = _randn(3, 6, 6).requires_grad_(True)
        return [x], [x]

    check_function(fn, make)


def test_softmax_no_grad_inference() -> None:
    def make():
        x = _randn(16, 6)
        return [x], [x.t()]

    with torch.no_grad():
        check_function(lambda x: F.softmax(x, dim=-1) + F.log_softmax(x, dim=0), make,
                       grad=False)
