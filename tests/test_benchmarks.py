"""The benchmark harness (benchmarks/run.py): its table, its summary, and one real
run of a case on the CPU. Timings are printed and written, never asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from rewritec.benchmarks.run import BackendResult, CaseResult, Probe, markdown, summary

COLUMNS = ("| case | eager ms | inductor ms | rewritec ms | inductor speedup | rewritec speedup "
           "| rewritec/inductor | GB/s (rewritec) | % copy BW | cold compile rw / ind (s) "
           "| warm compile rw / ind (s) | status |")
ENV = {"device": "cpu", "device_name": "test CPU", "torch": "t", "triton": "t", "python": "p",
       "rewritec": "r", "git_commit": "c", "date": "d", "timing": "perf_counter",
       "load_average": "0 0 0"}


def _case(name: str, eager: float, inductor: float, rewritec: float, **rw: object
          ) -> CaseResult:
    return CaseResult(name=name, label=name, description=name, eager_ms=eager,
                      backends={"inductor": BackendResult(ms=inductor),
                                "rewritec": BackendResult(ms=rewritec, **rw)})  # type: ignore[arg-type]


def test_summary_takes_the_geomean_over_matching_cases_and_counts_fallbacks() -> None:
    results = [_case("a", 4.0, 2.0, 1.0), _case("b", 4.0, 1.0, 2.0),
               _case("c", 9.0, 3.0, 3.0, fallback=["graph g0 falls back"]),
               _case("d", 1.0, 1.0, 0.1, mismatch="max abs diff 3")]
    s = summary(results)
    assert s["cases"] == 3 and s["fallback_cases"] == 1
    assert math.isclose(s["rewritec_over_inductor"], (0.5 * 2.0 * 1.0) ** (1 / 3))
    assert math.isclose(s["rewritec_speedup"], (4.0 * 2.0 * 3.0) ** (1 / 3))
    assert math.isclose(s["inductor_speedup"], (2.0 * 4.0 * 3.0) ** (1 / 3))


def test_the_table_has_every_column_and_flags_what_went_wrong() -> None:
    ok = _case("pointwise", 2.0, 1.0, 0.5)
    ok.memory_bound, ok.bytes_moved = True, 10**6
    # the median of each backend's pairs: 1.0 of (1.3, 0.9, 1.0)
    ok.probes = {"rewritec": Probe(cold_runs=[1.3, 0.9, 1.0], warm_runs=[0.2, 0.25, 0.1]),
                 "inductor": Probe(cold_runs=[5.0], warm_runs=[1.0])}
    text = markdown([ok, _case("fell", 1.0, 1.0, 1.0, fallback=["no lark"]),
                     _case("wrong", 1.0, 1.0, 1.0, mismatch="max abs diff 3")],
                    ENV, copy_gbps=4.0, quick=True, wall_s=1.0)
    assert COLUMNS in text
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| case")}
    assert rows["pointwise"].endswith("| 1.00 / 5.00 | 0.20 / 1.00 | ok |")
    assert "| 2.0 | 50% |" in rows["pointwise"]  # 1 MB in 0.5 ms, of 4 GB/s
    assert rows["fell"].endswith("| ok (fallback) [1] |")  # the note: its warning
    assert "MISMATCH" in rows["wrong"]
    assert "1 of these case(s) ran a graph through ATen" in text
    assert "1. `fell`: no lark" in text


def test_a_quick_cpu_run_writes_its_table_and_results(tmp_path: Path) -> None:
    """One case end to end, as `make bench-quick` runs them all."""
    out = tmp_path / "cpu.md"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--device", "cpu",
         "--cases", "gelu_bias", "--probe-cases", "none", "--repeats", "3", "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600, check=False,
        env=dict(os.environ, REWRITEC_CACHE_DIR=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text == proc.stdout[proc.stdout.index("# rewritec benchmarks"):][:len(text)]
    assert "# rewritec benchmarks: cpu (quick)" in text and "- device: " in text
    assert COLUMNS in text
    [row] = [line for line in text.splitlines() if line.startswith("| gelu_bias")]
    assert row.endswith("| ok |"), row
    raw = json.loads(out.with_suffix(".json").read_text())
    [case] = raw["cases"]
    assert case["status"] == "ok" and case["backends"]["rewritec"]["graphs"] == {"compiled": 1}
    assert all(case["backends"][b]["ms"] > 0 for b in ("inductor", "rewritec"))
