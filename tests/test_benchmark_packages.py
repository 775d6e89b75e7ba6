"""benchmarks/packages.py on the CPU: a package written, loaded and first called in a
fresh process, equal to eager; the table names it. No timing is asserted (the
torch.compile and AOTInductor columns compile for tens of seconds: not run here)."""

from __future__ import annotations

import torch

from rewritec.benchmarks.packages import markdown, measure


def test_package_row_in_a_fresh_process() -> None:
    rows = measure("reduce", torch.device("cpu"), repeats=1, ways=("rewritec",))
    assert len(rows) == 1 and "error" not in rows[0], rows
    assert rows[0]["err"] < 1e-5 and rows[0]["first_result_s"] > 0 and rows[0]["mb"] > 0
    env = {"device_name": "CPU (cpu)", "torch": "t", "triton": "t", "python": "p",
           "git_commit": "c", "date": "d", "command": "python -m benchmarks.packages"}
    table = markdown(rows, env, repeats=1)
    assert "| reduce | rewritec package |" in table
