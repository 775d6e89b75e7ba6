"""The rule-expression parser: its table of common mistakes and their hints,
and positions carried into the rule file."""

from __future__ import annotations

import pytest

from rewritec.engine.errors import RuleError, Where
from rewritec.engine.syntax import EXAMPLE_ERRORS, parse_expr, show


@pytest.mark.parametrize("text,hint", EXAMPLE_ERRORS, ids=[t for t, _ in EXAMPLE_ERRORS])
def test_example_error_gets_its_hint(text: str, hint: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_expr(text, Where("rules/x.yaml", 7, 14, "some-rule"))
    message = str(info.value)
    assert hint in message
    assert message.startswith("rules/x.yaml:7:") and "[some-rule]" in message


@pytest.mark.parametrize("text", ["sin(x)**2 + cos(x)**2", "sum(x, dim=[-1], keepdim=True)",
                                  "layer_norm(x, w, b)[0]", "dtype(x) in (f16, bf16)",
                                  "x.shape[-1] % 16 == 0 and not is_const(w)"])
def test_show_parses_back_to_the_same_tree(text: str) -> None:
    tree = parse_expr(text)
    assert parse_expr(show(tree)) == tree
