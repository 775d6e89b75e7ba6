"""Sibling reductions (rules/fuse/kernels.yaml `siblings: true`, engine/fuse.py
`_siblings`): reductions over the same dims of the same input shape that read what a
reduction kernel reads join it as more outputs, so one pass over the input computes
them all (layer norm's weight and bias gradients). Checked against eager in f32 and
halves, strided inputs, both CPU targets; what must not join (a reduction the group
reads, another signature) stays apart, and results stay eager's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets
from rewritec import report
from rewritec.engine.errors import RuleError, RuleErrors
from rewritec.rulesets import load_rule_files

DEVICE, TARGETS = kernel_targets()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _compile(fn, target: str):
    report.reset()
    torch._dynamo.reset()
    return torch.compile(fn, backend="rewritec", options={"target": target, "strict": True})


def _kernels(kind: str = "reduction") -> list[dict]:
    """The kernels of `kind` and of its multi-row variant (Triton's narrow rows)."""
    return [k for rec in report.RECORDS for k in rec.kernels
            if k["kind"] in (kind, f"{kind}_multi")]


def _close(got, want, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * scale)


def weight_and_bias(g: torch.Tensor, x: torch.Tensor):
    """A Linear's or a norm's parameter gradients: sums over every dim but the last."""
    dims = list(range(g.dim() - 1))
    return (g * x).sum(dims), g.sum(dims)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 48), (3, 17, 40), (1000, 7)], ids=str)
def test_column_sums_share_one_kernel(shape, dtype: torch.dtype, target: str) -> None:
    torch.manual_seed(shape[-1])
    g = torch.randn(shape, device=DEVICE, dtype=dtype)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    got = _compile(weight_and_bias, target)(g, x)
    _close(got, weight_and_bias(g, x), dtype, scale=float(shape[0]) ** 0.5)
    if target == "openmp" and dtype == torch.float16:
        return  # f16 stays on ATen on the CPU (kinds/kernels.py: CPP_DTYPES)
    kernels = _kernels()
    assert len(kernels) == 1 and kernels[0]["outputs"] == 2, kernels


@pytest.mark.parametrize("target", TARGETS)
def test_strided_inputs_and_three_kinds_of_reduction(target: str) -> None:
    """Transposed inputs (the reduced dim is not innermost: a reduction kernel, not a
    row kernel), a mean and an amax beside the sums, an epilogue on one."""
    def f(g, x):
        return (g * x).sum(1), g.mean(1) * 2.0, (g * g).amax(1), torch.exp(x).sum(1)

    torch.manual_seed(0)
    g = torch.randn(40, 33, device=DEVICE).t()
    x = torch.randn(40, 33, device=DEVICE).t()
    got = _compile(f, target)(g, x)
    _close(got, f(g, x), torch.float32, scale=10.0)
    kernels = _kernels("reduction") + _kernels("row")
    assert [k["outputs"] for k in kernels] == [4], kernels


@pytest.mark.parametrize("target", TARGETS)
def test_a_reduction_the_group_reads_stays_apart(target: str) -> None:
    """sum(x * sum(x)) needs sum(x) first: joined, the kernel would read its own
    output (the space refuses it; the order would have a cycle)."""
    def f(x):
        s = x.sum(0)
        return (x * s).sum(0), s

    x = torch.randn(50, 24, device=DEVICE)
    got = _compile(f, target)(x)
    _close(got, f(x), torch.float32, scale=50.0)
    assert len(_kernels()) == 2


@pytest.mark.parametrize("target", TARGETS)
def test_other_dims_stay_apart(target: str) -> None:
    def f(x):
        return x.sum(0), x.sum(1)

    x = torch.randn(30, 20, device=DEVICE)
    got = _compile(f, target)(x)
    _close(got, f(x), torch.float32, scale=6.0)
    assert all(k["outputs"] == 1 for k in _kernels("reduction") + _kernels("row"))


@pytest.mark.parametrize("target", TARGETS)
def test_a_sibling_read_by_an_aten_op_still_is_written(target: str) -> None:
    """Each output of the shared kernel reaches its own reader, kernel or ATen call."""
    def f(g, x):
        w, b = weight_and_bias(g, x)
        return torch.cumsum(b, 0), w + 1.0

    torch.manual_seed(1)
    g, x = torch.randn(2, 2, 16, 32, device=DEVICE).unbind(0)
    got = _compile(f, target)(g, x)
    _close(got, f(g, x), torch.float32, scale=30.0)
    assert any(k["outputs"] == 2 for k in _kernels())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "autocast"])
def test_layer_norm_weight_and_bias_gradients_in_one_pass(autocast: bool, target: str) -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.LayerNorm(24),
                                torch.nn.Linear(24, 8)).to(DEVICE)
    torch.nn.init.normal_(model[1].weight)
    compiled = _compile(model, target)
    x = torch.randn(4, 9, 24, device=DEVICE)

    def grads(fn):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = fn(x)
        return torch.autograd.grad(out.float().square().sum(), list(model.parameters()))

    want = grads(model)
    got = grads(compiled)
    tol = 3e-2 if autocast else 1e-4
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
    backward = [k for rec in report.RECORDS if rec.kind == "backward" for k in rec.kernels
                if k["kind"] == "reduction"]
    assert any(k["outputs"] >= 2 for k in backward), backward


@pytest.mark.parametrize("target", TARGETS)
def test_f32_layer_norm_between_bf16_layers(target: str) -> None:
    """CUDA's autocast runs layer_norm in f32 between bf16 products: the gradient
    arrives in bf16 and the saved input is f32. The row kernel of the input's gradient
    must not write an f32 g * x^ for the weight's sum (8 bytes an element moved,
    against 6 to compute it again where g and x are read): the weight's and bias's
    sums read g and x themselves, in one kernel."""
    torch.manual_seed(3)
    l1 = torch.nn.Linear(24, 24).to(DEVICE, torch.bfloat16)
    ln = torch.nn.LayerNorm(24).to(DEVICE)
    l2 = torch.nn.Linear(24, 8).to(DEVICE, torch.bfloat16)
    torch.nn.init.normal_(ln.weight)
    params = [*l1.parameters(), *ln.parameters(), *l2.parameters()]

    def f(x):
        return l2(ln(l1(x).float()).bfloat16())

    x = torch.randn(4, 9, 24, device=DEVICE, dtype=torch.bfloat16)
    compiled = _compile(f, target)
    want = torch.autograd.grad(f(x).float().square().sum(), params)
    got = torch.autograd.grad(compiled(x).float().square().sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2 * max(1.0, float(b.abs().max())))
    backward = [k for rec in report.RECORDS if rec.kind == "backward" for k in rec.kernels]
    assert any(k["kind"] == "reduction" and k["outputs"] == 2 for k in backward), backward
    assert all(k["outputs"] == 1 for k in backward if k["kind"].startswith("row")), backward


def test_siblings_is_a_boolean_on_fuse_rules(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent("""\
        kind: fuse
        rules:
          - name: my-reduction
            doc: "a reduction kernel"
            pattern: "@reduction"
            grow: [pointwise]
            siblings: sometimes
            kernel: reduction
            examples: [{expr: "sum(x, dim=[0], keepdim=False)", x: 4x8xf32}]
        """))
    with pytest.raises((RuleError, RuleErrors)) as err:
        load_rule_files([path])
    assert "siblings" in str(err.value) and "bad.yaml:7" in str(err.value)
