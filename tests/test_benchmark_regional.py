"""benchmarks/regional.py on the CPU: the tiny Llama compiles one region for all its
layers and matches eager. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from rewritec.benchmarks.model_zoo import BY_NAME
from rewritec.benchmarks.regional import child, markdown

pytestmark = pytest.mark.skipif(BY_NAME["llama"].missing() is not None,
                                reason="the suite's Llama needs transformers")


def test_regional_llama_compiles_one_layer_for_all() -> None:
    row = child(4, "infer", "regional", True, torch.device("cpu"), torch.float32)
    assert row["graphs"] == {"inference": 1, "region": 1} and row["fallbacks"] == 0
    assert row["layers"] == 4 and row["err"] < 1e-4
    table = markdown([row], {"device_name": "CPU (cpu)", "torch": "t", "transformers": "t",
                             "git_commit": "c", "date": "d", "command": "python -m x"})
    assert "| 4 | infer | regional |" in table and "1 inference, 1 region" in table
