"""The `profile` option (runtime/profile.py): every kernel launch and ATen call of a
compiled graph's calls is timed, under the names report.json gives them, one count
per call made; results stay those of eager, and a graph compiled without the option
has no timing line at all. The CUDA-event timer runs where there is a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import rewritec
import torch
from rewritec import cli, report
from rewritec.engine.errors import RewritecError
from rewritec.options import Options

CALLS = 3


def _model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A library call (mm), a row kernel (softmax) and a pointwise tail."""
    return (torch.softmax(x @ w, dim=-1) * 2 + 1).sin()


def _check_counts(rec: report.GraphRecord, calls: int) -> dict:
    """The graph's profile names each of its kernels and ATen ops once, counting
    one launch per call of the graph (an ATen op: one per wrapper line)."""
    p = rec.profile.to_json()
    assert p["calls"] == calls
    assert set(p["kernels"]) == {k["name"] for k in rec.kernels}
    assert {n: e["calls"] for n, e in p["kernels"].items()} == {
        k["name"]: calls for k in rec.kernels}
    assert {n: e["calls"] for n, e in p["aten"].items()} == {
        op: n * calls for op, n in rec.fallback_ops.items()}
    entries = [*p["kernels"].values(), *p["aten"].values()]
    assert all(e["total_s"] > 0 for e in p["kernels"].values())
    # a view launches nothing: between two CUDA events it may take no time at all
    assert all(e["total_s"] >= 0 and e["median_s"] >= 0 for e in entries)
    assert sum(e["share"] for e in entries) == pytest.approx(1.0, abs=1e-3)
    if p["timer"] == "perf_counter":
        assert p["measured_s"] <= p["total_s"]  # the parts fit in the whole call
    return p


def _run(fn, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    for _ in range(CALLS):
        out = fn(x, w)
        x.grad = w.grad = None
        out.sum().backward()
    return out.detach(), x.grad, w.grad


def test_profile_must_be_true_or_false() -> None:
    with pytest.raises(RewritecError, match="profile must be True or False"):
        Options.make(profile="yes")


@pytest.mark.parametrize("target", ["openmp", "triton"])
def test_profiled_graphs_match_eager_and_count_every_call(target: str) -> None:
    if target == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    x, w = torch.randn(16, 32), torch.randn(32, 24)
    want = _run(_model, x, w)
    plain = _run(rewritec.compile(_model, target=target), x, w)
    report.reset()
    timed = _run(rewritec.compile(_model, target=target, profile=True), x, w)
    for got in (plain, timed):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(timed, plain, strict=True):
        assert torch.equal(a, b), "timing changed a result"
    assert [r.kind for r in report.RECORDS] == ["forward", "backward"]
    for rec in report.RECORDS:
        p = _check_counts(rec, CALLS)
        assert p["timer"] == "perf_counter"
    assert any(rec.kernels for rec in report.RECORDS)


def test_a_graph_without_the_option_has_no_timing_line(tmp_path: Path) -> None:
    fn = rewritec.compile(_model, out_dir=str(tmp_path))
    fn(torch.randn(4, 8), torch.randn(8, 8))
    (rec,) = report.RECORDS
    source = Path(rec.files["wrapper"]).read_text()
    assert rec.kernels and "aten.mm" in source
    assert "_start" not in source and "_stop" not in source
    assert rec.profile is None
    assert json.loads((tmp_path / "report.json").read_text())["graphs"][0]["profile"] is None


def test_report_json_gets_the_times_when_written_again(tmp_path: Path) -> None:
    fn = rewritec.compile(_model, out_dir=str(tmp_path), profile=True)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for _ in range(CALLS):
        fn(x, w)
    (g,) = json.loads((tmp_path / "report.json").read_text())["graphs"]
    assert g["profile"]["calls"] == 0  # written as the graph compiled, before its calls
    source = Path(g["files"]["wrapper"]).read_text()
    assert source.count("_start()") == source.count("_stop(")
    rewritec.write_profiles()  # as at exit
    (g,) = json.loads((tmp_path / "report.json").read_text())["graphs"]
    assert g["profile"]["calls"] == CALLS
    assert set(g["profile"]["kernels"]) == {k["name"] for k in g["kernels"]}
    html = (tmp_path / "report.html").read_text()
    assert 'class="times sortable"' in html
    for name in g["profile"]["kernels"]:
        assert f'href="#{g["name"]}-kernel-{name}"' in html


def test_the_times_are_written_at_exit(tmp_path: Path) -> None:
    code = ("import torch, rewritec\n"
            f"f = torch.compile(lambda x: (x.sin() * 2).softmax(-1), backend='rewritec', "
            f"options={{'out_dir': {str(tmp_path)!r}, 'profile': True}})\n"
            f"for _ in range({CALLS}):\n"
            "    f(torch.randn(8, 16))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0 and "not written" not in res.stderr, res.stderr[-2000:]
    (g,) = json.loads((tmp_path / "report.json").read_text())["graphs"]
    assert g["profile"]["calls"] == CALLS
    assert {n: e["calls"] for n, e in g["profile"]["kernels"].items()} == {
        k["name"]: CALLS for k in g["kernels"]}


def test_compile_prints_the_longest_kernels(tmp_path: Path, capsys) -> None:
    script = tmp_path / "script.py"
    script.write_text("import torch\n"
                      "f = torch.compile(lambda x: (x.sin() * 2).softmax(-1) + 1)\n"
                      "for _ in range(3):\n"
                      "    f(torch.randn(8, 16))\n")
    assert cli.main(["compile", str(script), "--out", str(tmp_path / "out"), "--profile"]) == 0
    printed = capsys.readouterr().out
    table = printed.split("top ", 1)[1]
    (g,) = json.loads((tmp_path / "out" / "report.json").read_text())["graphs"]
    assert g["profile"]["calls"] == 3
    for name in g["profile"]["kernels"]:
        assert f"{g['name']}  kernel  {name}" in table
    assert not cli.main(["compile", str(script), "--out", str(tmp_path / "plain")])
    assert "by measured time" not in capsys.readouterr().out


def test_no_table_without_times() -> None:
    assert report.profile_table([{"name": "g0", "profile": None}]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_launches_are_timed_with_events() -> None:
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(128, 96, device="cuda")
    want = _run(_model, x, w)
    got = _run(rewritec.compile(_model, profile=True, cudagraphs="on"), x, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [r.kind for r in report.RECORDS] == ["forward", "backward"]
    for rec in report.RECORDS:
        assert _check_counts(rec, CALLS)["timer"] == "cuda_events"
        assert rec.cudagraphs.startswith("off: profile")  # each launch timed, not replayed
        assert rec.kernels
