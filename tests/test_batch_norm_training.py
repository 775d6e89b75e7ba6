"""Batch norm in training written out by rules (rules/decompose/norms.yaml,
batch-norm-train*, batch-norm-running-*, batch-norm-no-stats*, batch-norm-backward-*):
the statistics as reductions over every dim but the channels', the output and the
input's gradient as pointwise kernels; no ATen batch norm left, forward or backward.
Trained against eager, two steps each: the output, the gradients of the input, weight
and bias, and the running statistics and num_batches_tracked after the steps; 2-d and
1-d batch norms, NCHW and channels_last, affine or not, without running statistics,
f32, bf16, f16 and a ResNet block under autocast, a symbolic batch size; then eval
with the updated running statistics (batch-norm-eval)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable

import pytest
import torch

import rewritec  # noqa: F401 - registers the backend
from rewritec import report
from rewritec.runtime.build import cxx

from models import outside_ops, rules_fired

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
# Where the rules apply: Triton kernels replayed as CUDA graphs (more_launches); the
# OpenMP target keeps ATen's batch norm (test_batch_norm_stays_aten_where_it_is_faster)
TARGETS = ["triton"] if CUDA or INTERPRETED else []
# the ATen ops batch norm runs as when no rule writes it out
BATCH_NORM_OPS = {"_native_batch_norm_legit_functional", "_native_batch_norm_legit",
                  "native_batch_norm", "native_batch_norm_backward"}


class Block(torch.nn.Module):
    """A ResNet basic block: conv -> bn -> relu -> conv -> bn, + the residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + x)


def _bn(kind: type[torch.nn.Module], channels: int, **kw: object) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        bn = kind(channels, **kw)
        if getattr(bn, "affine", False):  # not 1 and 0: a wrong weight or bias shows
            torch.nn.init.normal_(bn.weight)
            torch.nn.init.normal_(bn.bias)
        return bn
    return make


def _step(model: torch.nn.Module, fn: Callable[..., torch.Tensor], x: torch.Tensor,
          cot: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    grads = torch.autograd.grad(out, [x, *model.parameters()], cot.to(out.dtype))
    return out.detach(), list(grads)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str,
           norm: bool = False) -> None:
    """Elementwise, the tolerance scaled by the largest value (a half rounds apart by
    one ulp of it); `norm`: the error over the whole tensor, relative to its size,
    for a block under autocast, where an activation rounded one bf16 ulp apart near
    zero flips its relu and that element's gradient (Triton kernels round a fused
    chain once, eager each op: so did the block before batch norm was written out)."""
    if norm:
        err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12))
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"
        return
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())),
                               msg=lambda m: f"{what}: {m}")


def _options(target: str, mode: str = "reduce-overhead", strict: bool = True
             ) -> dict[str, object]:
    """The rules are `more_launches` ones: on the Triton target they apply where graphs
    replay as CUDA graphs (rulesets.py: for_launches), as a user's mode asks."""
    return {"target": target, "strict": strict, "mode": mode}


def _train(make: Callable[[], torch.nn.Module], shape: tuple[int, ...], target: str,
           dtype: torch.dtype = torch.float32, channels_last: bool = False,
           autocast: bool = False, steps: int = 2, mode: str = "reduce-overhead",
           strict: bool = True
           ) -> tuple[torch.nn.Module, torch.nn.Module, Callable[..., torch.Tensor]]:
    """`steps` training steps of a model and of its compiled copy on the same inputs,
    compared; returns both models (their running statistics updated) and the compiled
    one."""
    torch.manual_seed(len(shape) + shape[-1])
    ref = make().to(DEVICE)
    if not autocast:
        ref.to(dtype)
    mine = copy.deepcopy(ref)
    compiled = torch.compile(mine, backend="rewritec", options=_options(target, mode, strict))
    tol = 2e-2 if dtype != torch.float32 or autocast else 1e-5
    if autocast and target == "triton":
        # eager's own bf16 gradients are 1-3% from f32 ones at these sizes, mostly from
        # relu masks near zero; Triton rounds differently from eager, and so lands as
        # far from eager as eager is from f32 (as the block did before batch norm was
        # written out): a wrong statistic or cast is off by far more
        tol = 1e-1
    for i in range(steps):
        # a mean away from 0 and a spread away from 1: the statistics are not trivial
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 1.5 + 0.5
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        cot = torch.randn(shape, device=DEVICE)
        # replayed training graphs run convolutions NHWC (passes/layout.py), whose TF32
        # algorithms round apart from NCHW's: f32 compares f32
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled,
                                        allow_tf32=False):
            want, ref_grads = _step(ref, ref, x, cot, autocast)
            got, my_grads = _step(mine, compiled, x, cot, autocast)
        _close(got, want, tol, f"step {i} output", autocast)
        for k, (g, w) in enumerate(zip(my_grads, ref_grads, strict=True)):
            _close(g, w, tol, f"step {i} gradient {k}", autocast)
    for (name, want), (_, got) in zip(ref.named_buffers(), mine.named_buffers(), strict=True):
        if name.endswith("num_batches_tracked"):
            assert int(got) == int(want) == steps, name
        else:
            _close(got, want, tol, name, autocast)
    return ref, mine, compiled


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (2, 16, 3, 3)], ids=str)
def test_batch_norm_2d_in_kernels(shape, channels_last: bool, target: str) -> None:
    _train(_bn(torch.nn.BatchNorm2d, shape[1]), shape, target, channels_last=channels_last)
    assert not BATCH_NORM_OPS & set(outside_ops())
    fired = rules_fired()
    for rule in ("batch-norm-train", "batch-norm-train-mean", "batch-norm-train-invstd",
                 "batch-norm-running-mean", "batch-norm-running-var",
                 "batch-norm-backward-input", "batch-norm-backward-weight",
                 "batch-norm-backward-bias"):
        assert fired[rule] == 1, rule
    # the weight's and the bias's gradients are two sums over the same dims, which the
    # input's gradient reads too: no mean is taken again for it
    (backward,) = [r for r in report.RECORDS if r.kind == "backward"]
    assert sum(k["ops"].get("sum", 0) for k in backward.kernels) == 2
    assert not any(k["ops"].get("mean", 0) for k in backward.kernels)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shape", "affine"), [((9, 3), True), ((5, 3, 11), False)], ids=str)
def test_batch_norm_1d_in_kernels(shape, affine: bool, target: str) -> None:
    _train(_bn(torch.nn.BatchNorm1d, shape[1], affine=affine), shape, target)
    assert not BATCH_NORM_OPS & set(outside_ops())
    if not affine:
        assert rules_fired()["batch-norm-train-no-affine"] == 1
        assert rules_fired()["batch-norm-backward-input-no-weight"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_batch_norm_without_running_stats(target: str) -> None:
    """track_running_stats=False: the batch's statistics in training and in eval."""
    _, mine, compiled = _train(_bn(torch.nn.BatchNorm2d, 5, track_running_stats=False),
                               (3, 5, 4, 6), target)
    assert rules_fired()["batch-norm-no-stats"] == 1
    mine.eval()
    x = torch.randn(3, 5, 4, 6, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mine(x))
    assert not BATCH_NORM_OPS & set(outside_ops())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_statistics_in_one_pass(target: str, dtype: torch.dtype) -> None:
    """The mean and the variance come from one pass over x (both sums of x shifted by
    one value of each channel): one reduction kernel in the forward, with both."""
    _train(_bn(torch.nn.BatchNorm2d, 6), (4, 6, 5, 5), target, dtype=dtype)
    (forward,) = [r for r in report.RECORDS if r.kind == "forward"]
    reductions = [k for k in forward.kernels if k["ops"].get("mean")]
    assert [k["ops"]["mean"] for k in reductions] == [2]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("value,where", [
    (math.inf, (0, 0, 0, 0)),
    (-math.inf, (0, 0, 0, 0)),
    (math.nan, (0, 0, 0, 0)), (math.inf, (2, 1, 3, 3)), (-math.inf, (2, 1, 3, 3)),
    (math.nan, (2, 1, 3, 3))], ids=str)
def test_statistics_of_an_inf_or_nan(target: str, value: float, where) -> None:
    """An inf or nan in x, at the value the variance is shifted by or elsewhere: the
    output, and the running statistics (eager's mean of a channel with one inf is
    that inf), have eager's values and eager's nan."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).to(DEVICE)
    mine = copy.deepcopy(bn)
    compiled = torch.compile(mine, backend="rewritec", options=_options(target))
    x = torch.randn(4, 3, 5, 5, device=DEVICE)
    x[where] = value
    for _ in range(2):  # the second call replays
        want, got = bn(x), compiled(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(mine.running_mean, bn.running_mean, equal_nan=True)
    torch.testing.assert_close(mine.running_var, bn.running_var, equal_nan=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("offset", [1e4, -3e3])
def test_statistics_of_a_large_mean(target: str, offset: float) -> None:
    """A mean 1e4 times the spread: E[x^2] - E[x]^2 unshifted would lose every digit
    of the variance in f32 (E[x^2] ~ 1e8, its rounding ~ 6); shifted by a value of each
    channel, the output and the running variance stay as close to f64 as eager's."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).to(DEVICE)
    mine = copy.deepcopy(bn)
    compiled = torch.compile(mine, backend="rewritec", options=_options(target))
    x = torch.randn(8, 3, 6, 6, device=DEVICE) * torch.tensor([1.0, 0.5, 2.0], device=DEVICE
                                                               ).view(3, 1, 1) + offset
    exact = copy.deepcopy(bn).double()
    for _ in range(2):  # the second call replays
        want, got, ref = bn(x), compiled(x), exact(x.double())
    for name, value, ref_value in (("output", got, ref), ("running_var", mine.running_var,
                                                          exact.running_var)):
        eager_value = want if name == "output" else bn.running_var
        err = float((value.double() - ref_value).abs().max())
        eager_err = float((eager_value.double() - ref_value).abs().max())
        assert err <= 4 * eager_err + 1e-5, f"{name}: {err:.2e} against eager's {eager_err:.2e}"
    assert not BATCH_NORM_OPS & set(outside_ops())


def _half_targets() -> list[str]:
    # OpenMP kernels compute bf16 but not f16 (it stays with ATen on the CPU)
    return ["triton"] if CUDA or INTERPRETED else []


@pytest.mark.parametrize("target", _half_targets())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_batch_norm_half_in_kernels(dtype: torch.dtype, target: str) -> None:
    _train(_bn(torch.nn.BatchNorm2d, 3), (4, 3, 5, 7), target, dtype=dtype)
    assert not BATCH_NORM_OPS & set(outside_ops())
    fired = rules_fired()
    for rule in ("batch-norm-train-half", "batch-norm-train-mean-half",
                 "batch-norm-train-invstd-half", "batch-norm-running-mean-half-cast",
                 "batch-norm-running-var-half-cast", "batch-norm-backward-input-half",
                 "batch-norm-backward-weight-half", "batch-norm-backward-bias-half"):
        assert fired[rule] == 1, rule


@pytest.mark.parametrize("target", TARGETS)
def test_resnet_block_under_autocast_then_eval(target: str) -> None:
    """bf16 convolution outputs into f32 batch norms, as CPU autocast leaves them;
    then eval, which reads the running statistics the compiled steps wrote."""
    ref, mine, compiled = _train(lambda: Block(8), (2, 8, 6, 6), target, autocast=True)
    assert not BATCH_NORM_OPS & set(outside_ops())
    assert rules_fired()["batch-norm-running-mean-half"] == 2  # the f32 buffers, updated in f32
    ref.eval()
    mine.eval()
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        _close(compiled(x), ref(x), 2e-2, "eval", norm=True)


@pytest.mark.parametrize("target", TARGETS)
def test_eval_after_training(target: str) -> None:
    """Eval after compiled training steps: batch-norm-eval with the running statistics
    the steps updated gives eager's result, and no batch norm runs as ATen."""
    ref, mine, compiled = _train(lambda: Block(8), (2, 8, 6, 6), target)
    ref.eval()
    mine.eval()
    report.reset()
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    # an inference graph's convolutions may run NHWC (passes/layout.py), whose TF32
    # algorithms round apart from NCHW's (the context manager: another test may have
    # frozen the global flags)
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled,
                                    allow_tf32=False), torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x))
    assert rules_fired()["batch-norm-eval"] == 2
    assert "_native_batch_norm_legit_no_training" not in outside_ops()


def test_momentum_none_matches_eager() -> None:
    """momentum=None (a cumulative average): nn.BatchNorm reads num_batches_tracked
    with .item(), a graph break, and TorchDynamo runs the batch norm eagerly; the
    steps still match eager's."""
    target = TARGETS[0] if TARGETS else "aten"
    _train(_bn(torch.nn.BatchNorm2d, 3, momentum=None), (4, 3, 5, 5), target, steps=3)


def test_symbolic_batch_size() -> None:
    """dynamic=True: with the batch size symbolic, n = numel / C is unknown, so the
    input's gradient takes means (batch-norm-backward-input-symbolic) and the running
    variance ATen's unbiased var (batch-norm-running-var-symbolic); no batch norm runs
    as ATen, at either batch size."""
    target = TARGETS[0] if TARGETS else "aten"
    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), _bn(torch.nn.BatchNorm2d, 4)(),
                              torch.nn.ReLU()).to(DEVICE)
    mine = copy.deepcopy(ref)
    compiled = torch.compile(mine, backend="rewritec", dynamic=True,
                             options=_options(target))
    for n in (3, 5):
        x = torch.randn(n, 3, 7, 6, device=DEVICE)
        cot = torch.randn(n, 4, 5, 4, device=DEVICE)
        want, ref_grads = _step(ref, ref, x, cot, False)
        got, my_grads = _step(mine, compiled, x, cot, False)
        _close(got, want, 1e-5, f"batch {n} output")
        for k, (g, w) in enumerate(zip(my_grads, ref_grads, strict=True)):
            # the convolution's bias gradient is 0 but for rounding: 1e-5 of the rest
            _close(g, w, 1e-4 if k == 2 else 1e-5, f"batch {n} gradient {k}")
    for (name, want), (_, got) in zip(ref.named_buffers(), mine.named_buffers(), strict=True):
        _close(got.float(), want.float(), 1e-5, name)
    if target != "aten":
        assert not BATCH_NORM_OPS & set(outside_ops())
        fired = rules_fired()
        assert fired["batch-norm-backward-input-symbolic"] >= 1
        assert fired["batch-norm-running-var-symbolic"] >= 1


def test_a_replacement_computes_its_numbers() -> None:
    """`rm * (1.0 - mo)` (mo bound to an attribute) and `s / channel_count(x)` in a
    replacement, as batch-norm-running-mean and batch-norm-backward-input write them:
    no op takes two numbers, so the builder computes each number as it computes an
    attribute (engine/pattern.py: Builder)."""
    from rewritec.rulecheck import build_example
    from rewritec.rulesets import builtin_rules

    rule = next(r for r in builtin_rules() if r.name == "batch-norm-running-mean")
    graph, *_ = build_example(rule, {"expr": "x * (1.0 - mo) + x / channel_count(x)",
                                     "x": "2x3x4xf32", "mo": 0.25})
    (root,) = graph.outputs
    assert root.op == "add"
    scaled, divided = root.args
    assert (scaled.op, scaled.args[1].op, scaled.args[1].value) == ("mul", "const", 0.75)
    assert (divided.op, divided.args[1].op, divided.args[1].value) == ("div", "const", 8)


STAYS = ([("triton", "default")] if CUDA or INTERPRETED else []) + \
    ([("openmp", "default"), ("openmp", "reduce-overhead")] if cxx() and not CUDA else [])


@pytest.mark.parametrize(("target", "mode"), STAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_norm_stays_aten_where_it_is_faster(target: str, mode: str,
                                                  dtype: torch.dtype) -> None:
    """Triton in default mode (each launch costs host time) and the OpenMP target in
    any mode (ATen's batch norm is as fast there): the rules, `more_launches`, do not
    apply; batch norm runs as ATen, forward and backward, and the steps are eager's.
    In bf16 on the CPU, ATen's op returns bf16 running statistics where its fake
    tensors say f32: the C++ kernel casting them must not read them as f32 (it did:
    garbage running means), so that call runs through ATen (CppLauncher.check_dtypes;
    not strict, which would raise)."""
    torch._dynamo.reset()
    report.reset()
    _train(_bn(torch.nn.BatchNorm2d, 3), (4, 3, 5, 5), target, dtype=dtype, mode=mode,
           strict=False)
    assert not any(name.startswith("batch-norm") for name in rules_fired())
    assert BATCH_NORM_OPS & set(outside_ops())


def test_more_launches_is_a_flag(tmp_path) -> None:
    """`more_launches:` takes true or false; anything else names the file and line."""
    from rewritec.engine.errors import RuleErrors
    from rewritec.rulesets import load_rule_files

    path = tmp_path / "r.yaml"
    path.write_text("kind: decompose\nrules:\n  - name: r\n    doc: relu\n"
                    "    pattern: relu(x)\n    replace: relu(x)\n    more_launches: 2\n"
                    "    examples: [{x: 4xf32}]\n")
    with pytest.raises(RuleErrors, match=r"r\.yaml:7.*more_launches"):
        load_rule_files([path])
