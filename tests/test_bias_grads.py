"""A Linear's bias gradient under autocast: sum over the rows with keepdim, a view
dropping the kept dim, a cast to the parameter's f32 (rules/simplify/views.yaml:
view-of-keepdim-sum). Without the view the cast is the reduction kernel's epilogue:
one kernel a bias, not a reduction and a lone cast. Against eager on every kernel
target, 2-d and 3-d inputs, f32 and bf16 autocast."""

from __future__ import annotations

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, rules_fired
from rewritec import report

DEVICE, TARGETS = kernel_targets()


def _step(model: torch.nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        return model(x).float().square().mean()


def _kernels(target: str, model: torch.nn.Module, x: torch.Tensor, autocast: bool,
             disable: tuple[str, ...] = ()) -> tuple[list[dict], list[torch.Tensor]]:
    report.reset()
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    step = torch.compile(_step, backend="rewritec",
                         options={"target": target, "disable": list(disable)})
    step(model, x, autocast).backward()
    backward = [k for r in report.RECORDS if r.kind == "backward" for k in r.kernels]
    return backward, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
@pytest.mark.parametrize("shape", [(24, 16), (3, 10, 16)], ids=str)
def test_a_bias_gradient_and_its_cast_are_one_kernel(target, autocast, shape) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8)).to(DEVICE)
    x = torch.randn(*shape, device=DEVICE)
    model.zero_grad(set_to_none=True)
    _step(model, x, autocast).backward()
    want = [p.grad.clone() for p in model.parameters()]
    tol = {"atol": 2e-2, "rtol": 2e-2} if autocast else {}
    kernels, got = _kernels(target, model, x, autocast)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
    assert rules_fired()["view-of-keepdim-sum"] == 2
    before, _ = _kernels(target, model, x, autocast, disable=("view-of-keepdim-sum",))
    if autocast:  # each bias's lone cast joined its reduction
        assert len(kernels) == len(before) - 2, ([k["ops"] for k in kernels],
                                                  [k["ops"] for k in before])
    else:
        assert len(kernels) <= len(before)
