"""Class-index losses (cross entropy, nll_loss) in training graphs, against eager.

The front end writes nll_loss's pick of the target column as a comparison of the
column positions with the targets (frontend/decompositions.py) and keeps
log_softmax decomposed in joint graphs, so the loss's forward is one row kernel
over the logits and its backward another, with no gather, scatter or [N, C] zero
tensor, and the backward reads the logits instead of saved log-probabilities.
Each case compares the loss and the logits' gradient with eager, forward and
backward, over reductions, ignored targets, dtypes and targets."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec import report

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _targets(n: int, c: int, ignore: int | None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(c, (n,), generator=g)
    if ignore is not None:
        t[::3] = ignore  # every third row ignored
    return t


def _check(loss_fn, logits: torch.Tensor, target: torch.Tensor, tol: float | None,
           options: dict | None = None) -> list:
    mine = logits.detach().clone().requires_grad_()
    ref = logits.detach().clone().requires_grad_()
    start = len(report.RECORDS)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="rewritec",
                             options={"strict": True, **(options or {})})
    got, want = compiled(mine, target), loss_fn(ref, target)
    kw = {"rtol": tol, "atol": tol} if tol else {}
    torch.testing.assert_close(got, want, equal_nan=True, **kw)
    cot = torch.randn_like(want)
    (g,), (r,) = torch.autograd.grad(got, [mine], cot), torch.autograd.grad(want, [ref], cot)
    torch.testing.assert_close(g, r, equal_nan=True, **kw)
    return report.RECORDS[start:]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [None, -100, 2], ids=str)
@pytest.mark.parametrize("shape", [(6, 33), (5, 1000)], ids=str)
def test_cross_entropy_matches_eager(shape, ignore, reduction) -> None:
    torch.manual_seed(0)
    n, c = shape
    logits = torch.randn(n, c) * 3
    target = _targets(n, c, ignore)
    kw = {} if ignore is None else {"ignore_index": ignore}
    records = _check(lambda x, t: F.cross_entropy(x, t, reduction=reduction, **kw),
                     logits, target, None)
    forward = [r for r in records if r.kind == "forward"]
    backward = [r for r in records if r.kind == "backward"]
    assert forward and backward
    for r in records:  # the picks run inside kernels: no library gather or scatter
        assert not {"gather", "scatter", "zeros_like"} & set(r.fallback_ops), r.fallback_ops
    # log-probabilities, the pick and the gradient: one row kernel each way
    assert sum(k["kind"].startswith("row") for k in forward[0].kernels) == 1, forward[0].kernels
    assert sum(k["kind"].startswith("row") for k in backward[0].kernels) == 1, backward[0].kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_as_a_language_model_loss(dtype) -> None:
    """`logits.float()` then a view, as Hugging Face's causal-LM loss writes it."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 77).to(dtype)
    target = _targets(10, 77, -100)

    def loss(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float().view(-1, 77), t, ignore_index=-100)

    _check(loss, logits, target, 1e-2)


def test_weighted_and_smoothed_losses_keep_their_meaning() -> None:
    """Weights take torch's own decomposition; label smoothing adds a row sum."""
    torch.manual_seed(0)
    logits = torch.randn(7, 12)
    target = _targets(7, 12, -100)
    w = torch.rand(12) + 0.5
    _check(lambda x, t: F.cross_entropy(x, t, weight=w, ignore_index=-100), logits, target,
           None)
    _check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), logits,
           _targets(7, 12, None), None)
    _check(lambda x, t: F.nll_loss(F.log_softmax(x, -1), t, reduction="sum"), logits,
           _targets(7, 12, None), None)


def test_every_target_ignored_is_nan_as_in_eager() -> None:
    logits = torch.randn(4, 9)
    _check(lambda x, t: F.cross_entropy(x, t), logits, torch.full((4,), -100), None)


def test_backward_reads_the_logits_not_saved_log_probabilities(tmp_path: Path) -> None:
    """log_softmax stays decomposed in joint graphs: the forward saves per-row maxima
    and log-sums ([N, 1]), not [N, C] log-probabilities."""
    logits = torch.randn(8, 50)
    _check(lambda x, t: F.cross_entropy(x, t), logits, _targets(8, 50, None), None,
           {"out_dir": str(tmp_path)})
    (captured,) = tmp_path.glob("*backward.captured.txt")
    header = captured.read_text().split("\n", 2)[1]  # the forward(...) signature
    saved = [t for name, t in re.findall(r'(\w+): "([^"]+)"', header)
             if not name.startswith(("primals_", "tangents_"))]
    assert "f32[8, 50]" not in saved, header  # only the logits, which it is given
    assert saved.count("f32[8, 1]") == 2, header


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("looped", [False, True], ids=["whole-rows", "looped-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_kernels_pick_the_targets(dtype, looped, monkeypatch) -> None:
    """Rows in registers, and rows read in chunks (64 columns here), where the
    forward's max and exp-sum share a pass (kinds/row_looped.py: online-softmax)."""
    if looped:
        from rewritec.kinds import row_looped
        from rewritec.kinds import spec as spec_mod
        monkeypatch.setattr(row_looped, "PERSISTENT_ROW_MAX_COLS", 64)
        monkeypatch.setattr(spec_mod, "LOOPED_BLOCK_C", 64)
        monkeypatch.setattr(spec_mod, "STATIC_LOOPED_BLOCK_C", 64)
        monkeypatch.setattr(spec_mod, "STATIC_WHOLE_ROW_C", 32)
    torch.manual_seed(0)
    c = 201 if looped else 40
    logits = torch.randn(6, c).to(dtype)
    target = _targets(6, c, -100)
    tol = None if dtype == torch.float32 else 2e-2
    records = _check(lambda x, t: F.cross_entropy(x.float(), t), logits, target, tol,
                     {"target": "triton"})
    for r in records:
        assert not {"gather", "scatter", "eq"} & set(r.fallback_ops), r.fallback_ops
    if looped:
        assert sum(r.rules_fired.get("online-softmax", 0) for r in records) == 1


def test_integer_comparisons_join_kernels_and_stay_exact() -> None:
    """Integers past 2**24 compare exactly inside a kernel (loaded as integers)."""
    big = 2**24 + 1
    idx = torch.tensor([big, big + 1, 3, big])

    def f(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.where(i == big, x * 2.0, x + 1.0)

    x = torch.randn(4)
    got = rewritec.compile(f, strict=True, out_dir=None)(x, idx)
    torch.testing.assert_close(got, f(x, idx))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(64, 5000), (33, 50257)], ids=str)
def test_cuda_language_model_loss(shape) -> None:
    """A causal-LM loss over half logits on the GPU: looped row kernels (wide rows)."""
    torch.manual_seed(0)
    n, c = shape
    logits = torch.randn(n, c, device="cuda").to(torch.bfloat16)
    target = _targets(n, c, -100).cuda()
    records = _check(lambda x, t: F.cross_entropy(x.float(), t, ignore_index=-100), logits,
                     target, 1e-2)
    for r in records:
        assert not {"gather", "scatter", "eq"} & set(r.fallback_ops), r.fallback_ops


def test_an_inf_or_nan_gradient_stays_at_the_target() -> None:
    """ATen scatters -grad into zeros: an inf or nan incoming gradient reaches the
    target's logit only, not every logit of its row through 0 * nan."""
    torch.manual_seed(0)
    logits = torch.randn(4, 9)
    target = torch.tensor([1, 8, 0, 3])
    mine = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    torch._dynamo.reset()
    fn = lambda x, t: F.nll_loss(x, t, reduction="none")  # noqa: E731 - on log-probabilities
    cot = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    (g,) = torch.autograd.grad(torch.compile(fn, backend="rewritec",
                                             options={"strict": True})(mine, target), [mine], cot)
    (r,) = torch.autograd.grad(fn(ref, target), [ref], cot)
    torch.testing.assert_close(g, r, equal_nan=True)
