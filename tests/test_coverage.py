"""Fusion coverage (coverage.py, docs/report.md#coverage): which ops count, and the
share of them a compiled graph runs inside kernels, checked on graphs whose mix of
kernel work, library calls, views and ATen-only ops is known."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rewritec
from rewritec import compiler, report
from rewritec.runtime.build import cxx
from rewritec.coverage import Coverage, measure, op_class

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", [
    "mm", "addmm", "bmm", "attention", "rewritec::attention", "convolution",  # op table
    "convolution_backward", "matmul", "linear", "baddbmm", "cudnn_convolution",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_efficient_attention_forward",
    "_flash_attention_backward", "_transformer_encoder_layer_fwd",
    "_c10d_functional::all_reduce"])
def test_library_calls_are_extern(name: str) -> None:
    assert op_class(name) == "extern"


@pytest.mark.parametrize("name", [
    "view", "reshape", "_unsafe_view", "unsafe_view", "permute", "t", "transpose", "expand",
    "unsqueeze", "squeeze", "alias", "slice", "select",  # op table
    "split", "split_with_sizes", "getitem", "detach", "as_strided", "unbind", "sym_size",
    "empty", "operator.mul", "builtins.max"])
def test_views_and_host_ops_launch_no_kernel(name: str) -> None:
    assert op_class(name) == "no_kernel"


@pytest.mark.parametrize("name", [
    "add", "mul", "to", "_to_copy", "clone", "cumsum", "cat", "constant_pad_nd", "full",
    "embedding", "embedding_dense_backward", "index_put", "native_layer_norm",
    "native_layer_norm_backward", "native_batch_norm", "batch_norm_eval",
    "_native_batch_norm_legit_no_training", "_softmax", "softmax", "where", "scalar_tensor",
    "prims::convert_element_type", "conj_physical"])
def test_kernel_work_is_counted(name: str) -> None:
    assert op_class(name) == "counted"


def test_externs_and_views_inside_a_kernel_add_nothing() -> None:
    cov = measure([{"mm": 1, "unsafe_view": 2, "add": 1, "relu": 1}, {"clone": 1}],
                  {"cumsum": 2, "reshape": 1, "addmm": 1, "_to_copy": 1})
    assert (cov.in_kernels, cov.outside, cov.extern, cov.no_kernel) == (3, 3, 2, 3)
    assert cov.outside_ops == {"cumsum": 2, "_to_copy": 1}
    assert cov.share == 0.5


def test_a_graph_of_views_and_library_calls_has_no_share() -> None:
    cov = measure([{"mm": 1, "view": 1}], {"addmm": 1, "t": 2})
    assert cov.share is None and cov.to_json()["share"] is None
    assert (cov + measure([], {"add": 1})).share == 0.0


def test_coverages_add_up() -> None:
    a = Coverage(3, {"cumsum": 1}, 1, 2)
    b = Coverage(1, {"cumsum": 2, "cat": 1}, 0, 5)
    assert a + b == Coverage(4, {"cumsum": 3, "cat": 1}, 1, 7)
    assert (a + b).share == 0.5


def test_every_coverage_key_is_documented() -> None:
    text = (REPO_ROOT / "docs" / "report.md").read_text()
    body = text.split("\n## Coverage", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", body, re.MULTILINE))
    assert documented == set(Coverage().to_json())


# -------------------------------------------------------------- compiled graphs


def mixed(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """mm (extern) with reshapes around it (views), five pointwise ops that can share
    a kernel (gelu, add, sin, cos, mul), a view, and cumsum, which no kernel computes."""
    h = torch.nn.functional.gelu(x @ w) + y
    return torch.cumsum((h.sin() * y.cos()).view(-1), 0)


POINTWISE = {"gelu": 1, "add": 1, "sin": 1, "cos": 1, "mul": 1}
# f32 on the OpenMP target: the mm stays an ATen call; f16 on Triton: fuse-matmul
# takes the mm and a reshape into the kernel, which must not change the share.
TARGETS = [
    pytest.param("openmp", torch.float32,
                 marks=pytest.mark.skipif(cxx() is None, reason="no C++ compiler")),
    pytest.param("triton", torch.float16),
]


def inputs(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.randn(2, 8, 48, dtype=dtype, device=device),
            torch.randn(48, 32, dtype=dtype, device=device),
            torch.randn(2, 8, 32, dtype=dtype, device=device)]


def compiled_graph(dtype: torch.dtype, **options: object) -> report.GraphRecord:
    # Triton kernels run on a GPU where there is one, else interpreted on the CPU
    cuda = options.get("target") == "triton" and torch.cuda.is_available()
    args = inputs(dtype, "cuda" if cuda else "cpu")
    out = rewritec.compile(mixed, **options)(*args)
    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype == torch.float16 else {}
    torch.testing.assert_close(out.float(), mixed(*args).float(), **tol)  # type: ignore[arg-type]
    [rec] = report.RECORDS
    return rec


@pytest.mark.parametrize(("target", "dtype"), TARGETS)
def test_mixed_graph_counts_the_pointwise_kernel_and_leaves_cumsum(
        target: str, dtype: torch.dtype) -> None:
    rec = compiled_graph(dtype, target=target)
    assert rec.status == "compiled" and len(rec.kernels) == 1, rec.kernels
    cov = rec.coverage()
    assert cov.in_kernels == 5 and cov.outside_ops == {"cumsum": 1}
    assert cov.share == pytest.approx(5 / 6) and rec.to_json()["coverage"]["share"] == 0.8333
    assert cov.extern == 1 and cov.no_kernel >= 1  # the mm; the view(-1) at least
    kernel_ops = rec.kernels[0]["ops"]
    assert {op: kernel_ops[op] for op in POINTWISE} == POINTWISE
    if dtype == torch.float16:  # the matmul kernel holds the mm and a reshape
        assert kernel_ops.get("mm") == 1 and len(kernel_ops) > len(POINTWISE) + 1, kernel_ops
    table = report.summary_table(report.RECORDS)
    assert re.search(rf"{rec.name} .* 83%", table), table
    assert f"outside kernels: {rec.name}: cumsum x1" in table


def test_without_rewriting_every_counted_op_is_outside() -> None:
    rec = compiled_graph(torch.float32, rewrite=False)
    cov = rec.coverage()
    assert rec.status == "compiled" and not rec.kernels
    assert cov.share == 0.0 and cov.in_kernels == 0
    assert cov.outside_ops == {**POINTWISE, "cumsum": 1}
    assert cov.extern == 1 and cov.no_kernel >= 1


def test_a_graph_that_falls_back_lists_every_captured_op(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(compiler, "_compile", broken)
    with pytest.warns(compiler.RewritecWarning, match="no compiler today"):
        rec = compiled_graph(torch.float32)
    assert rec.status == "fallback"
    cov = rec.to_json()["coverage"]
    assert cov["share"] == 0.0 and cov["in_kernels"] == 0
    assert cov["outside_ops"] == {**POINTWISE, "cumsum": 1}
    # the captured graph: mm; view, _unsafe_view and view(-1) around it
    assert cov["excluded"] == {"extern": 1, "no_kernel": 3}
    assert rec.fallback_ops["mm"] == 1 and "getitem" not in rec.fallback_ops
