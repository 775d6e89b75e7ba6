"""The data-parallel benchmark (benchmarks/multigpu.py) on the CPU with gloo: two
processes train tiny GPT-2 under DDP and FSDP2, eager and rewritec; its table and rows
file. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="the suite's GPT-2 needs transformers, which is not installed"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with the gloo backend is not available"),
]


def test_ddp_and_fsdp2_rows_agree_with_eager(tmp_path: Path) -> None:
    from rewritec.benchmarks.multigpu import main

    out = tmp_path / "mg.md"
    argv = ["--device", "cpu", "--tiny", "--world", "2", "--models", "gpt2",
            "--backends", "eager,rewritec", "--steps", "1", "--warmup", "2",
            "--timeout", "240", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert {(r["wrapper"], r["backend"]) for r in rows} == {
        (w, b) for w in ("ddp", "fsdp2") for b in ("eager", "rewritec")}
    for wrapper in ("ddp", "fsdp2"):
        eager, ours = (next(r for r in rows if r["wrapper"] == wrapper and r["backend"] == b)
                       for b in ("eager", "rewritec"))
        assert "error" not in ours, ours
        assert len(ours["losses"]) == 2
        for got, want in zip(ours["losses"], eager["losses"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), (wrapper, ours["losses"], eager["losses"])
        assert "0 fell back" in ours["path"], ours["path"]
    table = out.read_text()
    assert "| gpt2 | fsdp2 | rewritec |" in table and "failed" not in table
