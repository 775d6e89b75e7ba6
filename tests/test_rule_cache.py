"""The parsed built-in rules are cached between processes (rulesets.builtin_rules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewritec import rulesets


def _fresh(monkeypatch: pytest.MonkeyPatch, cache: Path) -> tuple:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(cache))
    rulesets.builtin_rules.cache_clear()
    try:
        return rulesets.builtin_rules()
    finally:
        rulesets.builtin_rules.cache_clear()


def test_cached_rules_equal_parsed_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = _fresh(monkeypatch, tmp_path)
    [entry] = tmp_path.glob("rules-*.pickle")
    cached = _fresh(monkeypatch, tmp_path)
    assert [(r.name, r.location, r.kind) for r in cached] == \
        [(r.name, r.location, r.kind) for r in parsed]
    assert entry.stat().st_size > 0


def test_corrupted_rule_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = _fresh(monkeypatch, tmp_path)
    [entry] = tmp_path.glob("rules-*.pickle")
    entry.write_bytes(b"not a pickle")  # its recorded hash no longer matches
    again = _fresh(monkeypatch, tmp_path)
    assert [r.name for r in again] == [r.name for r in parsed]
    assert entry.read_bytes() != b"not a pickle"
