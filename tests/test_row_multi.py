"""Narrow rows, several a program (kinds/row_multi.py): a Triton row kernel of a
static width up to MULTI_ROW_MAX_COLS lays ROWS rows out as a [ROWS, BLOCK_C] block.
Differential against eager, forward and backward, over widths, dtypes and layouts,
with ROWS above 1 and a last program past the last row (the launcher's lower bound on
programs is lifted, so small tensors take several rows a program too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import kernel_targets, tol
from rewritec import report
from rewritec.kinds import row
from rewritec.runtime import launch
from test_kernels import _check

ROWS_PER_PROGRAM = launch.rows_per_program  # before any test's fixture replaces it

DEVICE, TARGETS = kernel_targets()
pytestmark = pytest.mark.skipif("triton" not in TARGETS, reason="Triton kernels only")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def several_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """ROWS of each launch. 1024 values a program and no fewest programs: every width
    here up to 300 takes several rows a program, some over several programs with the
    last one part full."""
    seen: list[int] = []
    real = launch.rows_per_program

    def spy(block: int, rows: int) -> int:
        seen.append(real(block, rows))
        return seen[-1]

    monkeypatch.setattr(launch, "MULTI_ROW_MIN_PROGRAMS", 1)
    monkeypatch.setattr(launch, "MULTI_ROW_VALUES", 1024)
    monkeypatch.setattr(launch, "rows_per_program", spy)
    return seen


def _kinds() -> list[str]:
    return [k["kind"] for r in report.RECORDS for k in r.kernels]


def _run(fn, *inputs: torch.Tensor, dtype: torch.dtype, grad: bool = True) -> None:
    # halves: a gradient of [D] weights sums rows of half products, which Triton's
    # interpreter rounds by truncation (2-3x eager's error, as the one-row template's)
    _check(fn, "triton", *inputs, grad=grad,
           tol=tol(dtype)["rtol"] if dtype == torch.float32 else 0.1)
    assert "row_multi" in _kinds(), _kinds()


def softmax(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x + b, dim=-1)


def log_softmax(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x * b, dim=-1)


def layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w, w * 0.5)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 49), (3, 5, 96), (2, 3, 300), (5, 1)], ids=str)
@pytest.mark.parametrize("fn", [softmax, log_softmax, layer_norm, rms_norm],
                         ids=lambda f: f.__name__)
def test_narrow_rows_match_eager(fn, shape, dtype: torch.dtype, several_rows) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    _run(fn, x, w, dtype=dtype)
    rows = x.numel() // shape[-1]
    assert any(1 < r < rows or (r > 1 and rows % r) for r in several_rows), several_rows


@pytest.mark.parametrize("layout", ["transposed", "sliced", "broadcast"])
@pytest.mark.usefixtures("several_rows")
def test_strided_inputs(layout: str) -> None:
    """Inputs read through strides: each element's offset, and each row's, from the
    row's index in a [ROWS, 1] block."""
    torch.manual_seed(1)
    if layout == "transposed":
        x = torch.randn(40, 6, device=DEVICE).t()
    elif layout == "sliced":
        x = torch.randn(6, 80, device=DEVICE)[:, ::2]
    else:
        x = torch.randn(1, 40, device=DEVICE).expand(6, 40)
    _run(softmax, x, torch.randn(40, device=DEVICE), dtype=torch.float32, grad=False)


@pytest.mark.usefixtures("several_rows")
def test_rows_along_a_middle_dim() -> None:
    """A softmax along dim 1: the row dim is the space's last, read with a stride."""
    torch.manual_seed(2)
    x = torch.randn(3, 33, 5, device=DEVICE, requires_grad=False)
    _run(lambda x, b: torch.softmax(x * b, dim=1), x, torch.randn(5, device=DEVICE),
         dtype=torch.float32)


@pytest.mark.usefixtures("several_rows")
def test_per_row_side_outputs_and_inputs() -> None:
    """A layer norm in training saves its mean and rstd, one value per row (stored
    masked past the last row), and its backward reads them back (per-row loads)."""
    torch.manual_seed(3)
    ln = torch.nn.LayerNorm(96).to(DEVICE)
    x = torch.randn(13, 96, device=DEVICE)
    _run(lambda x, w: F.layer_norm(x, (96,), w, ln.bias), x, ln.weight.detach().clone(),
         dtype=torch.float32)
    kinds = [k["kind"] for r in report.RECORDS if r.kind == "backward" for k in r.kernels]
    assert "row_multi" in kinds, kinds


@pytest.mark.usefixtures("several_rows")
def test_embedding_rows_and_a_narrow_cross_entropy() -> None:
    """A take of whole rows (an embedding read by a norm) and a cross entropy over 37
    classes (the class index as an iota along the row)."""
    torch.manual_seed(4)
    table = torch.randn(50, 24, device=DEVICE)
    ids = torch.randint(0, 50, (3, 7), device=DEVICE)
    _check(lambda t: rms_norm(F.embedding(ids, t), t[0]), "triton", table, grad=True)
    assert "row_multi" in _kinds(), _kinds()
    logits = torch.randn(11, 37, device=DEVICE)
    labels = torch.randint(0, 37, (11,), device=DEVICE)
    _check(lambda z: F.cross_entropy(z, labels), "triton", logits, grad=True)
    assert "row_multi" in _kinds(), _kinds()


@pytest.mark.usefixtures("several_rows")
def test_the_variant_follows_the_width() -> None:
    """Up to MULTI_ROW_MAX_COLS columns row_multi, then the one-row template."""
    cols = row.MULTI_ROW_MAX_COLS
    for width, kind in ((cols, "row_multi"), (cols + 1, "row")):
        x = torch.randn(4, width, device=DEVICE)
        _check(softmax, "triton", x, torch.randn(width, device=DEVICE))
        assert _kinds() == [kind], (width, _kinds())


@pytest.mark.parametrize("block", [16, 64, 128, 512])
@pytest.mark.parametrize("rows", [1, 700, 5000, 10**6])
def test_rows_per_program_defaults(block: int, rows: int) -> None:
    """Without the fixture: a power of two, at most MULTI_ROW_VALUES values a program,
    and at least MULTI_ROW_MIN_PROGRAMS programs where the rows allow (else one row a
    program); as many rows as the values allow when there are rows enough."""
    per = ROWS_PER_PROGRAM(block, rows)
    assert per >= 1 and per & (per - 1) == 0
    assert per == 1 or per * block <= launch.MULTI_ROW_VALUES
    assert per == 1 or -(-rows // per) >= launch.MULTI_ROW_MIN_PROGRAMS
    if rows >= launch.MULTI_ROW_VALUES * launch.MULTI_ROW_MIN_PROGRAMS:
        assert per == max(1, launch.MULTI_ROW_VALUES // block)
