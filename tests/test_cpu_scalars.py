"""A 0-d CPU tensor in a CUDA graph: ATen's ops take one beside CUDA tensors (a clamp's
bound, T5's decoder start token copied into its shifted labels), a kernel's arguments
must be on its device, and a rewrite must not move a value to another device
(copy(cuda, cpu 0-d) is a CUDA tensor; expand(cpu 0-d) is a CPU one).

These compile for CUDA on fake tensors, so a CPU machine checks what the compiler
decides; the GPU runs the same graphs in tests/test_clamp.py and test_copy_rules.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from rewritec import report
from rewritec.compiler import compile_fx
from rewritec.options import Options


def _compile_for_cuda(fn: Any, *specs: tuple[tuple[int, ...], torch.dtype, str]
                      ) -> report.GraphRecord:
    """Trace `fn` on fake tensors of `specs` (shape, dtype, device) and compile it for
    Triton as a CUDA graph would be; the record of what was decided."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    report.reset()
    compile_fx(gm, args, Options(strict=True, target="triton"), kind="inference")
    (rec,) = report.RECORDS
    assert rec.status == "compiled", rec.reason
    return rec


def _kernel_ops(rec: report.GraphRecord) -> set[str]:
    return {op for k in rec.kernels for op in k["ops"]}


@pytest.mark.parametrize("bound_device", ["cpu", "cuda"])
def test_a_cpu_value_stays_out_of_cuda_kernels(bound_device: str) -> None:
    """maximum(x, lo) with lo a 0-d CPU tensor is ATen's, which takes it so, not a
    kernel's, whose arguments are on its device."""
    def fn(x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x * 2.0, lo) + 1.0

    rec = _compile_for_cuda(fn, ((4, 8), torch.float32, "cuda"), ((), torch.float32, bound_device))
    if bound_device == "cpu":
        assert "maximum" not in _kernel_ops(rec) and rec.fallback_ops["maximum"] == 1
    else:
        assert "maximum" in _kernel_ops(rec) and "maximum" not in rec.fallback_ops


@pytest.mark.parametrize("bound_device", ["cpu", "cuda"])
def test_a_clamp_bound_on_another_device_is_left_to_aten(bound_device: str) -> None:
    """clamp_min(x, lo) is maximum(x, lo) (rules/decompose/activations.yaml), but
    CUDA's clamp_min refuses a CPU bound where maximum takes it: the rule leaves that
    clamp to ATen, which raises as eager does."""
    def fn(x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        return torch.clamp_min(x * 2.0, lo) + 1.0

    rec = _compile_for_cuda(fn, ((4, 8), torch.float32, "cuda"), ((), torch.float32, bound_device))
    fired = rec.rules_fired.get("clamp-min-tensor", 0)
    assert fired == (bound_device == "cuda"), dict(rec.rules_fired)
    if bound_device == "cpu":
        assert rec.fallback_ops["clamp_min"] == 1


@pytest.mark.parametrize("start_device", ["cpu", "cuda"])
def test_a_copied_cpu_value_is_not_rewritten_to_a_cpu_view(start_device: str) -> None:
    """copy-of-0d (rules/simplify/casts.yaml) writes copy(x, y) as expand(y): for a CPU
    y that would be a CPU tensor where eager's copy gives a CUDA one, so the rewriter
    refuses it (a rewrite keeps the device)."""
    def fn(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        labels = torch.ops.aten.copy(torch.ops.aten.select(x, 1, 0), start)
        return labels * 3

    rec = _compile_for_cuda(fn, ((4, 8), torch.int64, "cuda"), ((), torch.int64, start_device))
    fired = rec.rules_fired.get("copy-of-0d", 0)
    assert fired == (start_device == "cuda"), dict(rec.rules_fired)
    if start_device == "cpu":
        assert rec.fallback_ops["copy"] == 1 and "expand" not in rec.fallback_ops


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_layer_norm_is_a_cpu_rule(weights: torch.dtype) -> None:
    """A bf16 input with f32 weights is ATen's mixed-type layer norm on the CPU only;
    CUDA's refuses it, so layer-norm-half leaves it to ATen there (which raises as eager
    does) and takes weights of the input's dtype."""
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (16,), w, b)

    rec = _compile_for_cuda(fn, ((4, 16), torch.bfloat16, "cuda"), ((16,), weights, "cuda"),
                            ((16,), weights, "cuda"))
    fired = rec.rules_fired.get("layer-norm-half", 0)
    assert fired == (weights == torch.bfloat16), dict(rec.rules_fired)
