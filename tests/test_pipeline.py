"""The pipeline is one ordered list of named passes, none special-cased by name."""

from __future__ import annotations

import inspect

from rewritec.engine import pipeline
from rewritec.engine.pipeline import PASSES


def test_passes_in_order_each_saying_why() -> None:
    assert [p.name for p in PASSES] == ["recognize", "decompose", "simplify", "layout", "fuse",
                                        "variants"]
    assert all(len(p.why) > 20 for p in PASSES)


def test_run_pipeline_asks_each_pass_not_its_name() -> None:
    source = inspect.getsource(pipeline.run_pipeline)
    assert ".name ==" not in source and "phase.name" not in source
