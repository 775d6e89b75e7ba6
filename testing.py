"""Helpers for users' own rule tests.

    from rewritec.testing import assert_fires

    def test_my_rule():
        assert_fires("mul-one", lambda x: x * 1 + 2, torch.randn(8))
"""

from __future__ import annotations

from typing import Any

import torch

from . import report
from .engine.rules import Rule


def assert_fires(rule: str | Rule, fn: Any, *inputs: Any, times: int | None = None,
                 rtol: float | None = None, atol: float | None = None, **options: Any) -> Any:
    """Compile `fn` with rewritec; assert `rule` fired (exactly `times` times if
    given) and the result equals eager. Returns the compiled result."""
    import rewritec

    name = rule.name if isinstance(rule, Rule) else rule
    options.setdefault("strict", True)
    if isinstance(rule, Rule) and not rule.fp_exact:
        options.setdefault("fast_math", True)
    torch._dynamo.reset()
    start = len(report.RECORDS)
    compiled = rewritec.compile(fn, **options)
    got = compiled(*inputs)
    want = fn(*inputs)
    records = report.RECORDS[start:]
    fired = sum(r.rules_fired.get(name, 0) for r in records)
    if times is None:
        assert fired > 0, (f"rule {name} did not fire; rules that fired: "
                           f"{sorted({k for r in records for k in r.rules_fired})}")
    else:
        assert fired == times, f"rule {name} fired {fired} times, expected {times}"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return got
