"""The models suite (benchmarks/models.py): tiny real models on the CPU, eager and
rewritec, inference and training; its table, summary and files. No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rewritec.benchmarks import models
from rewritec.benchmarks.model_zoo import Built, ModelSpec
from rewritec.benchmarks.models import (HEADER, Row, Settings, main, markdown, run_model,
                                        summary)
from rewritec.benchmarks.run import suite_of

# (model, the library it needs beyond torch)
TINY_MODELS = [("torch_encoder", None), ("gpt2", "transformers"), ("llama", "transformers")]
MODES = ("infer", "train")
BACKENDS = ("eager", "rewritec")


def run_suite(name: str, out: Path) -> dict[str, Any]:
    argv = ["--tiny", "--device", "cpu", "--models", name, "--modes", ",".join(MODES),
            "--backends", ",".join(BACKENDS), "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert main(argv) == 0
    return json.loads(out.with_suffix(".json").read_text())


def within_eager(err: float | None, eager_err: float | None) -> bool:
    """rewritec's error vs the fp32 reference: a few times eager's, plus a tolerance."""
    return err is not None and eager_err is not None and math.isfinite(err) \
        and err <= 4 * eager_err + 1e-4


@pytest.mark.parametrize(("name", "library"), TINY_MODELS)
def test_tiny_model_rows_match_the_fp32_reference(name: str, library: str | None,
                                                  tmp_path: Path) -> None:
    if library:
        pytest.importorskip(library)
    out = tmp_path / "models-cpu.md"
    data = run_suite(name, out)
    rows = {(r["mode"], r["backend"]): r for r in data["rows"]}
    assert set(rows) == {(m, b) for m in MODES for b in BACKENDS}
    for (mode, backend), r in rows.items():
        assert r["error"] is None, r["traceback"]
        assert r["ms"] > 0 and r["host_ms"] > 0 and r["first_call_s"] > 0
        assert r["gpu_ms"] is None and r["peak_mb"] is None and r["reserved_mb"] is None
        eager = rows[(mode, "eager")]
        assert within_eager(r["err"], eager["err"]), (mode, backend, r["err"])
        if mode == "train":
            assert within_eager(r["grad_err"], eager["grad_err"]), (backend, r["grad_err"])
    for mode in MODES:
        rw = rows[(mode, "rewritec")]
        assert rw["graphs"]["compiled"] >= 1 and rw["graphs"]["fallback"] == 0, rw["path"]
        assert rw["path"].startswith(f"{rw['graphs']['compiled']} compiled")
        assert rows[(mode, "eager")]["coverage"] is None
        cov = rw["coverage"]
        if cov["share"] is None:  # nn.Transformer's inference fast path: one library call
            assert (name, mode) == ("torch_encoder", "infer") and cov["excluded"]["extern"], cov
        else:
            assert cov["in_kernels"] > 0 and 0 < cov["share"] <= 1, cov
        assert cov["outside"] == sum(cov["outside_ops"].values()), cov
    text = out.read_text()
    assert "Outside kernels (rewritec" in text and f"- `{name}` (rewritec): " in text
    assert "| " + " | ".join(HEADER) + " |" in text
    for section in ("## infer", "## train", "## Summary", "## Columns", "- command: `"):
        assert section in text
    assert set(data["summary"]) == {"infer rewritec", "train rewritec"}


def test_a_missing_library_is_a_skipped_row() -> None:
    spec = ModelSpec("ghost", "llm", "no_such_library_here", lambda tiny: None,  # type: ignore[arg-type]
                     infer_batch=1, train_batch=1)
    settings = Settings(torch.device("cpu"), torch.float32, True, 1, 0, False)
    rows = run_model(spec, MODES, BACKENDS, settings)
    assert [(r.model, r.skipped) for r in rows] == [
        ("ghost", "needs no_such_library_here, which is not installed")]
    assert "`ghost` skipped: needs no_such_library_here" in markdown(rows, env())


def test_a_failing_backend_is_a_row_with_the_error_and_the_suite_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(models, "rewritec_backend", lambda: failing_backend)

    def build(tiny: bool) -> Built:
        return Built(torch.nn.Linear(4, 4), lambda b, d: {"x": torch.randn(b, 4, device=d)},
                     lambda m, x: m(x["x"]), lambda m, x: m(x["x"]).sum(), "4")

    spec = ModelSpec("broken", "llm", "torch", build, infer_batch=2, train_batch=2)
    settings = Settings(torch.device("cpu"), torch.float32, True, 1, 0, False)
    rows = run_model(spec, MODES, BACKENDS, settings)
    assert [(r.mode, r.backend) for r in rows] == [(m, b) for m in MODES for b in BACKENDS]
    for r in rows:
        if r.backend == "eager":
            assert r.error is None and r.ms is not None
        else:
            assert r.error is not None and "no kernel for this" in r.error, r.error
            assert "\n" not in r.error and "second line" not in r.error
    assert "ERROR: " in markdown(rows, env())


def test_summary_compares_with_inductors_best_and_counts_regressions() -> None:
    def row(model: str, backend: str, ms: float, host: float, peak: float) -> Row:
        return Row(model, "llm", "infer", backend, ms=ms, host_ms=host, peak_mb=peak)

    rows = [row("a", "eager", 10, 1, 0), row("a", "inductor", 4, 1, 5),
            row("a", "inductor-ro", 2, 0.5, 6), row("a", "rewritec", 3, 2, 4),
            row("b", "eager", 2, 1, 0), row("b", "inductor", 1, 1, 5),
            row("b", "rewritec", 4, 0.5, 9)]
    s = summary(rows)["infer rewritec"]
    assert s["models"] == 2
    assert math.isclose(s["geomean_vs_inductor_best"], math.sqrt((3 / 2) * (4 / 1)))
    assert (s["slower_than_eager"], s["more_memory"], s["more_host"]) == (1, 1, 1)


def test_cuda_graph_modes_compare_reserved_memory() -> None:
    """Inductor's CUDA-graph trees keep their pool out of the allocated counts (its
    reduce-overhead peaks read about 0 MB): those rows compare reserved memory."""
    def row(backend: str, peak: float, reserved: float) -> Row:
        return Row("a", "llm", "train", backend, ms=1.0, host_ms=1.0, peak_mb=peak,
                   reserved_mb=reserved)

    rows = [row("inductor", 900, 1000), row("rewritec", 800, 1200),
            row("inductor-ro", 0.001, 2900), row("rewritec-ro", 5800, 7700)]
    s = summary(rows)
    assert s["train rewritec"]["more_memory"] == 0  # peaks: 800 against 900
    assert s["train rewritec-ro"]["more_memory"] == 1  # reserved: 7700 against 2900
    rows[-1] = row("rewritec-ro", 5800, 2500)
    assert summary(rows)["train rewritec-ro"]["more_memory"] == 0


def test_kernels_are_told_apart_by_kind_and_tabled_with_the_pools() -> None:
    """The profile's kernels by kind (what a missed kernel or GPU-time target is made
    of) and the reserved memory by pool, under the table of their mode."""
    names = {
        "triton_poi_fused__to_copy_add_0": "generated",
        "triton_poi_fused_convolution_relu_3": "generated",  # a conv's epilogue
        "fuse_row_ad38b274": "generated",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>":
            "aten",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "aten",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul/conv",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul/conv",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
    }
    for name, kind in names.items():
        assert models.kernel_kind(name) == kind, name
    kernels = [("fuse_row_1", 10.0), ("fuse_row_1", 20.0), ("nvjet_x", 100.0),
               ("void at::native::elementwise_kernel<copy>", 5.0)]
    got = models.kernel_breakdown(kernels, steps=2)
    assert got["kinds"]["generated"] == {"count": 1.0, "ms": 0.015}
    assert got["kinds"]["matmul/conv"] == {"count": 0.5, "ms": 0.05}
    assert [t[0] for t in got["top"]] == ["fuse_row_1", "void at::native::elementwise_kernel<copy>"]
    rows = [Row("a", "llm", "train", "rewritec-ro", ms=1.0, kernel_breakdown=got,
                pools_mb={"graph pools": 1870.0, "shared": 620.0}),
            Row("a", "llm", "train", "eager", ms=2.0)]
    text = markdown(rows, env())
    line = next(x for x in text.splitlines() if x.startswith("| a | rewritec-ro | 1 /"))
    assert "| 1 / 0.015 | 0.5 / 0.0025 | 0.5 / 0.05 | — | 1870 | 620 |" in line, line
    assert "| a | eager |" not in text.split("Kernels by kind")[1]  # no profile: no row
    assert "Kernels by kind" not in markdown(rows[1:], env())


def test_coverage_adds_up_the_graphs_and_lists_what_stays_outside() -> None:
    from rewritec.report import GraphRecord

    def graph(inside: dict[str, int], outside: dict[str, int], status: str = "compiled",
              name: str = "g") -> GraphRecord:
        rec = GraphRecord(name=name, kind="forward", status=status, kernels=[{"ops": inside}])
        rec.fallback_ops.update(outside)
        return rec

    records = [graph({"add": 6, "mm": 1, "view": 2}, {"cumsum": 1, "addmm": 2}),
               graph({"mul": 2}, {"_to_copy": 3, "cumsum": 1, "t": 4}, name="g1"),
               graph({"relu": 5}, {"relu": 5}, status="fallback", name="g2")]
    assert models.coverage_of("eager", records) is None
    cov = models.coverage_of("rewritec-ro", records)
    assert cov is not None
    # ops weighted: (6 + 2) inside of (6 + 2) + (1 + 3 + 1 + 5) counted ops
    assert (cov["in_kernels"], cov["outside"], cov["share"]) == (8, 10, round(8 / 18, 4))
    assert cov["outside_ops"] == {"relu": 5, "_to_copy": 3, "cumsum": 2}
    assert cov["excluded"] == {"extern": 3, "no_kernel": 6}
    # per graph: 6/7, 2/6 and the fallback's 0/5: the lowest is the fallback's
    assert cov["lowest_graph"] == {"graph": "g2", "share": 0.0}
    ops = {f"op{i}": 20 - i for i in range(12)}
    rows = [Row("m", "llm", "train", "eager", ms=1.0),
            Row("m", "llm", "train", "rewritec", ms=1.0, coverage=cov),
            Row("m", "llm", "train", "rewritec-ro", ms=1.0, coverage=cov),
            Row("n", "llm", "train", "rewritec", ms=1.0,
                coverage={"share": 0.5, "outside_ops": ops})]
    text = markdown(rows, env())
    assert "| 44.4% |" in text and "| 50.0% |" in text
    assert ("- `m` (rewritec, rewritec-ro): 44.4% in kernels (lowest graph: 0.0%); "
            "outside: relu 5, _to_copy 3, cumsum 2\n") in text
    assert "op9 11, +2 more" in text and "op10" not in text


def test_run_delegates_the_models_suite() -> None:
    assert suite_of(["--suite", "models", "--tiny", "--models", "gpt2"]) == (
        "models", ["--tiny", "--models", "gpt2"])
    assert suite_of(["--quick"]) == ("cases", ["--quick"])


def env() -> dict[str, Any]:
    return {"device_name": "test CPU (cpu)", "torch": "t", "triton": "t", "transformers": "t",
            "timm": "t", "python": "p", "git_commit": "c", "date": "d", "command": "x",
            "steps": 1, "warmup": 0, "tiny": True, "dtype": "fp32"}
