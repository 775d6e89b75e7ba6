"""The `reduction` template (rules fuse-reduction, fuse-reduction-epilogue) and
the looped Triton row template against eager, on both targets (OpenMP C++ for
real, Triton through its interpreter): sets of reduced dims, keepdim, odd sizes,
layouts, dtypes, prologue and epilogue, nan and inf, backward graphs, the
split of a long reduction over many programs, and wide or symbolic rows.
Every case also checks which template made the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import rewritec
import torch
import torch.nn.functional as F
from rewritec import report
from rewritec.kinds import row_looped
from rewritec.kinds import spec as spec_mod
from rewritec.runtime import launch
from rewritec.runtime.build import cxx
from rewritec.runtime.reduction_launch import ReductionTritonLauncher
from test_kernels import (
    INTERPRETED,
    TARGETS,
    _check,
    _layout,
    col_sum,
    layer_norm,
    log_softmax,
    rms_norm,
    row_sum,
    softmax,
)


def _templates() -> set[str]:
    return {k["template"] for r in report.RECORDS for k in r.kernels}


def _run(fn, target: str, *inputs: torch.Tensor, template: str = "reduction",
         grad: bool = False, tol: float | None = None) -> None:
    """Compiled against eager (tests/test_kernels.py: _check), then: the kernel
    came from `template`."""
    _check(fn, target, *inputs, grad=grad, tol=tol)
    assert f"{target}/{template}" in _templates(), _templates()


def _run_nan(fn, target: str, *inputs: torch.Tensor) -> None:
    """As _run, nan in the same places as eager."""
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target=target, strict=True)(*inputs)
    torch.testing.assert_close(got, fn(*inputs), equal_nan=True)
    assert f"{target}/reduction" in _templates(), _templates()


# ------------------------------------------------------------------ which dims
def sum_dim0(x: torch.Tensor) -> torch.Tensor:
    return (x * 2.0).sum(0)


def sum_last(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x).sum(-1)


def sum_all(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def mean_all(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x).mean()


def amax_all(x: torch.Tensor) -> torch.Tensor:
    return x.amax()


def amin_all_keepdim(x: torch.Tensor) -> torch.Tensor:
    return torch.amin(x - 1.0, dim=(0, 1), keepdim=True)


REDUCE_2D = [sum_dim0, sum_last, sum_all, mean_all, amax_all, amin_all_keepdim]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fn", REDUCE_2D, ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "broadcast"])
def test_reduction_dims_and_layouts(target: str, fn, layout: str) -> None:
    # sums of up to 221 values, added in another order than ATen's
    _run(fn, target, _layout(layout, (13, 17), torch.float32), tol=1e-5)


def mean_02(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(0, 2))


def amax_12_keepdim(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=(1, 2), keepdim=True) * 2


def sum_02_keepdim(x: torch.Tensor) -> torch.Tensor:
    return torch.sum(torch.sigmoid(x), dim=(0, 2), keepdim=True) - 1.0


def amin_1(x: torch.Tensor) -> torch.Tensor:
    return x.amin(dim=1)


def mean_neg(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(-1, -3))


REDUCE_3D = [mean_02, amax_12_keepdim, sum_02_keepdim, amin_1, mean_neg, sum_all]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fn", REDUCE_3D, ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced"])
def test_reduction_dims_of_3d(target: str, fn, layout: str) -> None:
    x = torch.randn(5, 6, 7)
    if layout == "permuted":
        x = torch.randn(7, 5, 6).permute(1, 2, 0)
    elif layout == "sliced":
        x = torch.randn(5, 12, 7)[:, 1::2]
    _run(fn, target, x, tol=1e-5)


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("size", [1, 7, 1023, 4097, 5003])
@pytest.mark.parametrize("fn", [sum_dim0, sum_all, mean_all, amax_all],
                         ids=lambda f: f.__name__)
def test_reduction_sizes(target: str, size: int, fn) -> None:
    _run(fn, target, torch.randn(3, size), tol=1e-4)


def test_openmp_threads_share_a_long_reduction() -> None:
    """One output, 70001 elements: the OpenMP kernel's parallel-reduction branch."""
    if cxx() is None:
        pytest.skip("no C++ compiler")
    for fn in (sum_all, mean_all, amax_all):
        _run(fn, "openmp", torch.randn(70001), tol=1e-4)


# ------------------------------------------------------------------ dtypes
@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", [sum_dim0, mean_all, amax_12_keepdim, sum_02_keepdim],
                         ids=lambda f: f.__name__)
def test_half_precision_triton(dtype: torch.dtype, fn) -> None:
    shape = (13, 17) if fn in REDUCE_2D else (5, 6, 7)
    _run(fn, "triton", torch.randn(shape).to(dtype), tol=2e-2)


def test_float64_openmp() -> None:
    if cxx() is None:
        pytest.skip("no C++ compiler")
    _run(mean_02, "openmp", torch.randn(5, 6, 7, dtype=torch.float64))


# ------------------------------------------------------------------ prologue, epilogue
def norm_02(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sqrt((x * x * y * y).sum(dim=(0, 2)) + 1.0)


def sum_over_max(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Two reductions over the same dims in one kernel."""
    return (x + y).sum(dim=(0, 1)) / (x + y).abs().amax(dim=(0, 1))


def both_phases(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y is read by the prologue (broadcast over I) and by the epilogue (over O)."""
    return (x * y).sum(dim=(0, 1)) + y


def scaled_mean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x - y).mean() * 3.0 - 1.0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fn", [norm_02, sum_over_max, both_phases, scaled_mean],
                         ids=lambda f: f.__name__)
def test_prologue_and_epilogue(target: str, fn) -> None:
    _run(fn, target, torch.randn(4, 6, 7), torch.randn(7), tol=1e-5)


def test_variance_is_not_one_pass() -> None:
    """x - mean(x) feeding the output needs a second pass: no reduction kernel
    takes the group (ATen or other kernels compute it)."""
    if cxx() is None:
        pytest.skip("no C++ compiler")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=(0, 1), keepdim=True)

    _check(fn, "openmp", torch.randn(4, 5, 6), expect_kernels=False)
    kernels = [k for r in report.RECORDS for k in r.kernels]
    assert all(k["rules"] != ["fuse-reduction-epilogue"] for k in kernels)


# ------------------------------------------------------------------ nan and inf
def _special(shape: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(shape)
    x[0, 1] = float("nan")
    x[1, :] = float("inf")
    x[2, :] = float("-inf")
    x[3, 2] = float("-inf")
    x[3, 3] = float("inf")
    return x


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", ["amax", "amin", "sum"])
@pytest.mark.parametrize("dim", [(1,), (0, 1), None])
def test_nan_and_inf(target: str, op: str, dim) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        reduce = getattr(torch, op)
        return (reduce(x) if dim is None else reduce(x, dim=dim)) * 2.0

    _run_nan(fn, target, _special((5, 9)))


# ------------------------------------------------------------------ backward graphs
@pytest.mark.parametrize("target", TARGETS)
def test_linear_bias_gradient_3d(target: str) -> None:
    """The bias gradient of a linear over a 3-d input sums its output gradient
    over the first two dims (ATen: a view and a sum over one dim)."""
    w, b = torch.randn(5, 4), torch.randn(5)

    def fn(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, w, b))

    _check(fn, target, torch.randn(2, 3, 4), b, grad=True)


@pytest.mark.parametrize("target", TARGETS)
def test_backward_graphs(target: str) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) * y).mean(dim=(0, 1)) * 2.0

    _run(fn, target, torch.randn(3, 4, 9), torch.randn(9), template="reduction", grad=True)


@pytest.mark.parametrize("target", TARGETS)
def test_dynamic_shapes_reuse_one_kernel(target: str) -> None:
    torch._dynamo.reset()
    report.reset()
    compiled = rewritec.compile(sum_02_keepdim, target=target, strict=True, dynamic=True)
    for shape in [(3, 4, 5), (4, 4, 6), (2, 5, 7)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), sum_02_keepdim(x))
    assert f"{target}/reduction" in _templates()


# ------------------------------------------------------------------ split reduction (Triton)
@pytest.fixture
def splits(monkeypatch) -> list[int]:
    """Splits the Triton reduction down to 64 elements a program; records each split."""
    seen: list[int] = []
    split = ReductionTritonLauncher.split

    def record(self, *args) -> tuple[int, int]:
        got = split(self, *args)
        seen.append(got[0])
        return got

    monkeypatch.setattr(ReductionTritonLauncher, "SPLIT_MIN_ELEMENTS", 64)
    monkeypatch.setattr(ReductionTritonLauncher, "TILE", 256)
    monkeypatch.setattr(ReductionTritonLauncher, "split", record)
    return seen


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fn", [sum_all, mean_all, amax_all, sum_dim0, amin_all_keepdim],
                         ids=lambda f: f.__name__)
def test_split_reduction(splits: list[int], fn) -> None:
    _run(fn, "triton", torch.randn(37, 300).t(), tol=1e-4)
    assert max(splits) > 1


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_split_reduction_epilogue_and_nan(splits: list[int]) -> None:
    _run(sum_over_max, "triton", torch.randn(40, 50, 3), torch.randn(3), tol=1e-4)
    x = torch.randn(3000)
    x[2500] = float("nan")
    _run_nan(lambda x: x.amax() + 1.0, "triton", x)
    _run_nan(lambda x: x.amin(), "triton", x)
    assert max(splits) > 1


# ------------------------------------------------------------------ looped row kernel (Triton)
@pytest.fixture
def narrow_rows_loop(monkeypatch) -> None:
    """Rows past 64 columns loop, in chunks of 64: wide rows for the interpreter."""
    monkeypatch.setattr(row_looped, "PERSISTENT_ROW_MAX_COLS", 64)
    monkeypatch.setattr(spec_mod, "LOOPED_BLOCK_C", 64)
    monkeypatch.setattr(spec_mod, "STATIC_LOOPED_BLOCK_C", 64)
    monkeypatch.setattr(spec_mod, "STATIC_WHOLE_ROW_C", 32)


ROW_FUNCS = [softmax, log_softmax, layer_norm, rms_norm, row_sum, col_sum]


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fn", ROW_FUNCS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "broadcast"])
def test_looped_rows(narrow_rows_loop, fn, layout: str) -> None:
    x = _layout(layout, (150, 201) if fn is col_sum else (5, 201), torch.float32)
    # col_sum reads rows only where dim 0 is innermost in memory (reduces_innermost);
    # elsewhere it is a reduction kernel over column tiles
    # (for the broadcast input, eager's tanh(x) * y is row-major, so is the sum's input)
    columns = (fn is col_sum and layout != "transposed") or (fn is row_sum and
                                                             layout == "transposed")
    template = "reduction" if columns else "row_looped"
    # col_sum adds 150 rows: f32 rounding in another order than ATen's
    _run(fn, "triton", x, torch.randn(201), template=template, tol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", [softmax, layer_norm], ids=lambda f: f.__name__)
def test_looped_rows_half_precision(narrow_rows_loop, fn, dtype: torch.dtype) -> None:
    _run(fn, "triton", torch.randn(4, 130).to(dtype), torch.randn(130).to(dtype),
         template="row_looped", tol=2e-2)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_looped_layer_norm_variance_in_one_pass(narrow_rows_loop) -> None:
    """layer_norm's mean and variance come from one Welford pass over the row
    (kinds/row_looped.py): rows of one repeated value get a variance of exactly
    0, as ATen's, so sqrt(var) is 0, not nan; other rows match eager."""

    def f(x: torch.Tensor) -> torch.Tensor:
        var = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
        return torch.sqrt(var) + F.layer_norm(x, x.shape[-1:])

    x = torch.randn(6, 201) * 3 + 1
    x[1] = 0.1
    x[4] = -7.3
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(f, target="triton", strict=True, out_dir=None)(x)
    torch.testing.assert_close(got, f(x), rtol=1e-4, atol=1e-4)
    assert (got[1] == 0).all() and (got[4] == 0).all()
    assert "triton/row_looped" in _templates()
    paths = [Path(k["source"]) for r in report.RECORDS for k in r.kernels]
    assert any("_welford_combine" in p.read_text() for p in paths)
    # a named rewrite of the variants pass, counted as a rule's firing
    assert sum(r.rules_fired.get("welford-variance", 0) for r in report.RECORDS) == 1


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [softmax, log_softmax], ids=lambda f: f.__name__)
def test_looped_softmax_max_and_sum_in_one_pass(narrow_rows_loop, fn, dtype) -> None:
    """The online-softmax rewrite (kinds/row_looped.py: ONLINE) sums exp(x - max) in
    the max's pass: the kernel reads each row twice, not three times, and gives eager's
    values on rows whose max grows late, rows with -inf entries, a row of -inf only
    (nan, as eager), a row with nan, and huge values that a late max rescales."""
    x = torch.randn(7, 201) * 4
    x[0] = torch.linspace(-50, 50, 201)  # the max grows in every chunk
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    x[3, 150] = float("nan")
    x[4] = torch.linspace(80, -300, 201)  # exp overflows without the max
    x[5, 200] = 1e4
    x = x.to(dtype)
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(lambda a: fn(a, torch.ones(201)), target="triton", strict=True,
                           out_dir=None)(x)
    want = fn(x, torch.ones(201))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, equal_nan=True, rtol=tol, atol=tol)
    assert "triton/row_looped" in _templates()
    assert sum(r.rules_fired.get("online-softmax", 0) for r in report.RECORDS) == 1
    source = "".join(Path(k["source"]).read_text() for r in report.RECORDS for k in r.kernels)
    assert source.count("for c0 in range(0, n_cols, BLOCK_C)") == 2, source


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_welford_variance_is_a_traced_step_of_the_variants_pass(narrow_rows_loop) -> None:
    """kinds/row_looped.py: WELFORD. The variants pass marks the kernel, the trace
    shows the firing in phase `variants`, and only a marked kernel's render merges the
    variance into the mean's pass: unmarked, the same kernel reads the row once more."""
    from rewritec.engine.pipeline import run_pipeline
    from rewritec.engine.trace import Trace
    from rewritec.kinds import registry
    from rewritec.kinds.kernels import compilable
    from rewritec.kinds.variants import variants_for
    from rewritec.rulecheck import build_example
    from rewritec.rulesets import builtin_rules

    rule = next(r for r in builtin_rules() if r.name == "fuse-row")
    m = "mean(x, dim=[-1], keepdim=True)"
    var = f"mean((x - {m}) * (x - {m}), dim=[-1], keepdim=True)"
    example = {"expr": f"(x - {m}) * rsqrt({var} + 0.00001)", "x": "4x201xf32"}
    graph, store, _, _ = build_example(rule, example)
    trace = Trace()
    result = run_pipeline(graph, store, [rule], can_compile=compilable("triton"),
                          spaces=registry.SPACES, variants=variants_for("triton", store),
                          trace=trace)
    assert result.fired["welford-variance"] == 1
    (firing,) = [f for f in trace.firings if f.rule == "welford-variance"]
    assert firing.phase == "variants" and firing.location == "kinds/row_looped.py"
    (kernel,) = [t for t in result.graph.terms() if t.op == "kernel"]
    assert kernel is firing.after and kernel.attr("rewrites") == ("welford-variance",)
    spec = registry.kind("row").spec(kernel, 0)
    marked = row_looped.render_row_looped(spec)
    spec.meta["rewrites"] = ()
    plain = row_looped.render_row_looped(spec)
    assert "_welford_combine" in marked and "_welford_combine" not in plain
    assert plain.count("for c0 in") == marked.count("for c0 in") + 1


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fn", [softmax, log_softmax, rms_norm], ids=lambda f: f.__name__)
def test_looped_rows_symbolic_width(fn) -> None:
    """A symbolic width loops whatever its run-time value (default threshold)."""
    torch._dynamo.reset()
    report.reset()
    compiled = rewritec.compile(fn, target="triton", strict=True, dynamic=True)
    for rows, cols in [(3, 9), (4, 33), (2, 129)]:
        x, y = torch.randn(rows, cols), torch.randn(cols)
        torch.testing.assert_close(compiled(x, y), fn(x, y))
    assert "triton/row_looped" in _templates()


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("extra, template", [(0, "row"), (1, "row_looped")])
def test_wide_row_threshold(extra: int, template: str) -> None:
    from rewritec.kinds import row_looped

    cols = row_looped.PERSISTENT_ROW_MAX_COLS + extra
    _run(rms_norm, "triton", torch.randn(2, cols), torch.randn(cols), template=template)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("cols, blocks", [(100, (128, 64)), (300, (512, 64))])
def test_looped_chunk_static_and_symbolic(monkeypatch, cols: int, blocks: tuple) -> None:
    """A static width loops over chunks of up to STATIC_LOOPED_BLOCK_C, a symbolic
    one over LOOPED_BLOCK_C (kinds/spec.py: chunk)."""
    monkeypatch.setattr(row_looped, "PERSISTENT_ROW_MAX_COLS", 64)
    monkeypatch.setattr(spec_mod, "STATIC_LOOPED_BLOCK_C", 512)
    monkeypatch.setattr(spec_mod, "STATIC_WHOLE_ROW_C", 64)
    monkeypatch.setattr(spec_mod, "LOOPED_BLOCK_C", 64)
    seen = []
    real = spec_mod.chunk
    monkeypatch.setattr(launch, "chunk", lambda spec, block: seen.append(real(spec, block))
                        or seen[-1])
    x, w = torch.randn(3, cols), torch.randn(cols)
    _run(rms_norm, "triton", x, w, template="row_looped")
    assert seen[-1] == blocks[0]
    torch._dynamo.reset()
    f = rewritec.compile(rms_norm, target="triton", strict=True, dynamic=True)
    torch.testing.assert_close(f(x, w), rms_norm(x, w), rtol=1e-4, atol=1e-4)
    assert seen[-1] == blocks[1]


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("cols, block, warps", [(300, 512, 2), (600, 64, 1)])
def test_static_row_within_whole_row_limit_is_one_chunk(monkeypatch, cols: int, block: int,
                                                         warps: int) -> None:
    """A static row up to STATIC_WHOLE_ROW_C columns is read as one chunk, by the warps
    of a persistent row; a wider one in chunks of STATIC_LOOPED_BLOCK_C, by at most
    LOOPED_ROW_MAX_WARPS (kinds/spec.py: chunk, runtime/launch.py)."""
    monkeypatch.setattr(row_looped, "PERSISTENT_ROW_MAX_COLS", 64)
    monkeypatch.setattr(spec_mod, "STATIC_LOOPED_BLOCK_C", 64)
    monkeypatch.setattr(spec_mod, "STATIC_WHOLE_ROW_C", 512)
    monkeypatch.setattr(launch, "row_warps", lambda b: max(1, b // 256))
    monkeypatch.setattr(launch, "LOOPED_ROW_MAX_WARPS", 1)
    seen = []
    real = launch.LoopedRowTritonLauncher.warps
    monkeypatch.setattr(launch.LoopedRowTritonLauncher, "warps",
                        lambda self, b: seen.append((b, real(self, b))) or seen[-1][1])
    x, w = torch.randn(3, cols), torch.randn(cols)
    _run(rms_norm, "triton", x, w, template="row_looped")
    assert seen[-1] == (block, warps)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_looped_row_nan_and_inf(narrow_rows_loop) -> None:
    x = torch.randn(4, 100)
    x[0, 70] = float("nan")
    x[1, :] = float("-inf")
    x[2, 99] = float("inf")
    report.reset()
    torch._dynamo.reset()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x - x.amax(-1, keepdim=True) + x.amin(-1, keepdim=True) * 2.0

    got = rewritec.compile(fn, target="triton", strict=True)(x)
    torch.testing.assert_close(got, fn(x), equal_nan=True)
    assert "triton/row_looped" in _templates()


# ------------------------------------------- rows or columns (rules/fuse/kernels.yaml)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(64, 33), (7, 3, 40)])
def test_fuse_row_reduction_leaves_columns_to_the_reduction_template(target, dtype,
                                                                     shape) -> None:
    """A bias gradient (a sum over dim 0 of a row-major matrix) read as rows takes
    one memory line per value: `reduces_innermost` hands it to fuse-reduction. The
    same sum over an input whose dim 0 is innermost in memory stays a row kernel."""
    if dtype == torch.float16 and target == "openmp":
        pytest.skip("half-precision inputs: Triton only")
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    y = torch.randn(shape[-1:], generator=g).to(dtype)
    tol = 2e-2 if dtype == torch.float16 else None
    report.reset()
    _check(col_sum, target, x, y, tol=tol)
    fired = {k for r in report.RECORDS for k in r.rules_fired}
    assert "fuse-reduction" in fired and "fuse-row-reduction" not in fired, fired
    xt = torch.randn(shape[::-1], generator=g).to(dtype).permute(*reversed(range(len(shape))))
    report.reset()
    _check(col_sum, target, xt, y, tol=tol)
    assert {f"{target}/row", f"{target}/row_multi"} & _templates(), _templates()


def test_reduces_innermost_reads_strides_then_shape() -> None:
    from rewritec.engine.guards import _reduces_innermost
    from rewritec.engine.term import Meta, TermStore

    store = TermStore()

    def reduction(shape, strides, dims):
        # a new input each time: terms are hash-consed on op, arguments and attributes
        n = len(store)
        x = store.make("input", (), {"name": f"x{n}", "index": n, "kind": "input"},
                       meta=Meta(shape=shape, strides=strides))
        return store.make("sum", (x,), {"dim": dims, "keepdim": True}, meta=Meta())

    assert _reduces_innermost(reduction((8, 4), (4, 1), [1]))
    assert _reduces_innermost(reduction((8, 4), (4, 1), [-1]))
    assert not _reduces_innermost(reduction((8, 4), (4, 1), [0]))
    assert _reduces_innermost(reduction((8, 4), (1, 8), [0]))  # a transposed view
    assert _reduces_innermost(reduction((8, 4, 1), (4, 1, 1), [1]))  # trailing size-1 dim
    assert _reduces_innermost(reduction((8, 4), (), [1]))  # strides unknown: the last dim
    assert not _reduces_innermost(reduction((8, 4), (), [0]))
    assert not _reduces_innermost(reduction((8, 4), (4, 1), []))  # every dim: not a row


# ------------------------------------------------------------------ OpenMP column loop
def col_sum_bias(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum(0) + y[0]  # a prologue and an epilogue


def col_mean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x).mean(0) * 3.0


def col_amax_nan(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.amax(x, dim=0) - 1.0


def col_amin_3d(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.amin(x.reshape(x.shape[0], -1, 10), dim=0)  # two output dims


@pytest.mark.skipif(cxx() is None, reason="no C++ compiler")
@pytest.mark.parametrize("fn", [col_sum_bias, col_mean, col_amax_nan, col_amin_3d],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(37, 70), (5, 200), (300, 130)])
def test_openmp_column_loop(fn, shape: tuple[int, int]) -> None:
    """A reduction over dim 0 of a row-major matrix with 64 or more outputs reads it
    row by row, a vector of outputs at a time (templates/openmp/reduction.cpp.j2);
    outputs that do not fill the last block of 64, nan and inf, a prologue and an
    epilogue, two output dims: all equal eager."""
    x = torch.randn(shape)
    x[1, 3], x[2, 5], x[0, 7] = float("nan"), float("inf"), float("-inf")
    y = torch.randn(shape[1])
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target="openmp", strict=True)(x, y)
    torch.testing.assert_close(got, fn(x, y), equal_nan=True, rtol=1e-5, atol=1e-5)
    [kernel] = [k for r in report.RECORDS for k in r.kernels if k["template"].endswith("reduction")]
    assert "a vector of outputs at a time" in Path(kernel["source"]).read_text()


# ------------------------------------------------------------------ OpenMP runs
def channel_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * 2.0).sum((0, 2, 3))


def channel_variance(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A batch norm's variance pass: a [C] mean broadcast into the prologue."""
    d = x - m.view(1, -1, 1, 1)
    return (d * d).mean((0, 2, 3))


def channel_amax(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.amax(x + m.view(1, -1, 1, 1), dim=(0, 2, 3), keepdim=True)


def outer_and_inner(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * x).sum((0, 3))  # H is kept: W alone is a run


@pytest.mark.skipif(cxx() is None, reason="no C++ compiler")
@pytest.mark.parametrize("fn", [channel_sum, channel_variance, channel_amax, outer_and_inner],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize(("shape", "layout"), [
    ((5, 7, 19, 23), "contiguous"),   # H and W merge: runs of 437 across 512-element chunks
    ((3, 4, 30, 40), "contiguous"),   # runs of 1200, each split by the chunks
    ((4, 6, 33, 7), "contiguous"),    # W of 7 alone (H kept): element by element
    ((5, 7, 19, 23), "transposed"),   # W and H swapped: no merge, runs of 19 strided
    ((6, 5, 12, 20), "channels_last"),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_openmp_reads_the_innermost_reduced_dims_in_runs(fn, shape, layout: str,
                                                         dtype: torch.dtype) -> None:
    """Reductions over dims that are not innermost in memory (a batch norm's over N, H
    and W) read each run of the innermost reduced dims with offsets stepped, not
    divided out per element (kinds/reduction.py: _cpp_runs; the launcher merges H and
    W where they are contiguous, runtime/launch.py: merge_inner): equal eager."""
    x = torch.randn(shape) * 3 + 1
    if layout == "transposed":
        x = x.transpose(2, 3)
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x = x.to(dtype)
    m = torch.randn(x.shape[1]).to(dtype)
    report.reset()
    torch._dynamo.reset()
    got = rewritec.compile(fn, target="openmp", strict=True)(x, m)
    want = fn(x.double(), m.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    [kernel] = [k for r in report.RECORDS for k in r.kernels if k["template"].endswith("reduction")]
    assert "p / size3 + 1" in Path(kernel["source"]).read_text()


# ------------------------------------------------------------------ broadcast prologue
def _shifted_square_sum(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # exp(c) is [1, C, 1, 1]: computed per reduced element, read through the broadcast
    d = x - torch.exp(c.view(1, -1, 1, 1))
    return (d * d).sum((0, 2, 3)) + d.sum((0, 2, 3))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (2, 70, 3, 3)], ids=str)
def test_a_value_broadcast_to_the_input_joins_the_prologue(target, shape) -> None:
    """A per-channel value the prologue reads (batch norm's shift) is computed in the
    reduction kernel, which takes both sums in one pass: one kernel."""
    x, c = torch.randn(shape), torch.randn(shape[1]) * 0.1
    _run(_shifted_square_sum, target, x, c)
    kernels = [k for r in report.RECORDS for k in r.kernels]
    assert len(kernels) == 1, [k["ops"] for k in kernels]


def _channel_stats(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum((0, 2, 3)) - x.sum((0, 2, 3))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "nhwc-sliced", "hw-transposed"])
def test_channel_sums_over_merged_and_unmerged_dims(target, layout) -> None:
    """Sums over N, H and W, a batch norm's statistics, over layouts whose reduced dims
    the OpenMP launcher reads as one run (all three in NHWC, H and W in NCHW) or apart
    (a slice of W, H and W swapped)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, 7)
    if layout == "nhwc":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "nhwc-sliced":
        x = torch.randn(3, 5, 6, 9).to(memory_format=torch.channels_last)[..., 1:8]
    elif layout == "hw-transposed":
        x = torch.randn(3, 5, 7, 6).transpose(2, 3)
    _run(_channel_stats, target, x, tol=1e-4)
