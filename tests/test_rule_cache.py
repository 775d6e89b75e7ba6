"""The parsed built-in rules are kept between processes (rulesets.builtin_rules):
beside the rule files like Python's bytecode, or in the kernel cache when the
installation is read-only; a copy that fails its hash is parsed again."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewritec import rulesets


def _fresh(monkeypatch: pytest.MonkeyPatch, cache: Path, compiled: Path) -> tuple:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(cache))
    monkeypatch.setattr(rulesets, "COMPILED_DIR", compiled)
    rulesets._builtin.cache_clear()
    try:
        return rulesets.builtin_rules()
    finally:
        rulesets._builtin.cache_clear()


def _same(a: tuple, b: tuple) -> bool:
    return [(r.name, r.where, r.kind, r.pattern, r.replace) for r in a] == \
        [(r.name, r.where, r.kind, r.pattern, r.replace) for r in b]


def test_the_parsed_table_is_kept_beside_the_rules(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, cache = tmp_path / "__pycache__", tmp_path / "cache"
    parsed = _fresh(monkeypatch, cache, compiled)
    [entry] = compiled.glob("rules-*.pickle")
    assert not list(cache.glob("rules-*.pickle"))
    # a fresh kernel cache (a cold compile) still finds the table
    loaded = _fresh(monkeypatch, tmp_path / "another-cache", compiled)
    assert _same(loaded, parsed) and entry.stat().st_size > 0
    assert _same(parsed, tuple(rulesets._load([rulesets.RULES_DIR], builtin=True)))


def test_a_read_only_installation_keeps_it_in_the_kernel_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "installed"
    blocker.write_text("a file where the folder would go")  # mkdir fails, even as root
    parsed = _fresh(monkeypatch, tmp_path / "cache", blocker / "__pycache__")
    [entry] = (tmp_path / "cache").glob("rules-*.pickle")
    again = _fresh(monkeypatch, tmp_path / "cache", blocker / "__pycache__")
    assert _same(again, parsed) and entry.stat().st_size > 0


def test_a_corrupted_table_is_parsed_again(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = tmp_path / "__pycache__"
    parsed = _fresh(monkeypatch, tmp_path / "cache", compiled)
    [entry] = compiled.glob("rules-*.pickle")
    entry.write_bytes(b"not a pickle")  # its recorded hash no longer matches
    again = _fresh(monkeypatch, tmp_path / "cache", compiled)
    assert _same(again, parsed)
    assert entry.read_bytes() != b"not a pickle"


def test_an_edited_rule_file_is_parsed_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is keyed by each source's size and modification time: a rule file
    edited after the table was kept gives a new table with the edit in it."""
    import shutil

    rules = tmp_path / "rules"
    shutil.copytree(rulesets.RULES_DIR, rules, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(rulesets, "RULES_DIR", rules)
    compiled = rules / "__pycache__"
    before = {r.name: r.doc for r in _fresh(monkeypatch, tmp_path / "cache", compiled)}
    target = next(p for p in sorted(rules.rglob("*.yaml")) if "doc:" in p.read_text())
    text = target.read_text()
    old_doc = text.split("doc:", 1)[1].splitlines()[0].strip()
    target.write_text(text.replace(f"doc: {old_doc}", "doc: edited after the table was kept", 1))
    after = {r.name: r.doc for r in _fresh(monkeypatch, tmp_path / "cache", compiled)}
    changed = [name for name in before if before[name] != after[name]]
    assert len(changed) == 1 and after[changed[0]] == "edited after the table was kept"
    assert len(list(compiled.glob("rules-*.pickle"))) == 1  # the stale table is gone


def test_a_compilation_reads_no_yaml() -> None:
    """With the table kept, a compilation takes the op table from it too: it neither
    imports PyYAML nor reads rules/ops.yaml (15 ms of a cold compile on 2 cores)."""
    import subprocess
    import sys

    rulesets.builtin_rules()  # the table exists, as after an installation
    code = (
        "import sys, torch, rewritec\n"
        "from rewritec.engine import ops\n"
        "read = []\n"
        "parse = ops.load_op_table\n"
        "ops.load_op_table = lambda *a: read.append(1) or parse(*a)\n"
        "f = rewritec.compile(lambda x: torch.softmax(x * 2, -1).sum(0), target='auto')\n"
        "x = torch.randn(4, 8)\n"
        "torch.testing.assert_close(f(x), torch.softmax(x * 2, -1).sum(0))\n"
        "print('YAML', 'yaml' in sys.modules, len(read))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert "YAML False 0" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]
