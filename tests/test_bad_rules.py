"""A corpus of broken rule files, each with the exact error rewritec must give.

`tests/bad_rules/NAME.yaml` is a broken rule file; `NAME.expected` is the
error text, paths relative to the repository root (see bad_rules/README.md).
Two mechanisms produce that text, both in-process:

- load errors (every case but `loop_*`, `unsound_*` and `wrong_op_*`): the message
  of the `RuleError`/`RuleErrors` raised by `rulesets.load_rule_files([path])`
  (the loader, and the check of a user's templates, which sit in
  `bad_rules/templates/`), which is also what `rewritec ...` prints after
  `rewritec: error: ` (exit 2);
- rule-check problems (`loop_*`, `unsound_*`): the files load, and the
  problem lines of `rewritec rules check --rules PATH` for the file's own
  rules (`FILE:LINE: [rule] problem`, without the indentation) show why;
  for a user op (`wrong_op_*`), the problem lines of its comparison with ATen.

`REGEN=1 pytest tests/test_bad_rules.py` rewrites the .expected files from
what rewritec prints now, except for the xfail cases below: their .expected
holds the message rewritec *should* print, written by hand.

Every case must also keep a compilation that uses the file away from code
generation: `rewritec.compile(fn, rules=[path])` falls back to eager with a
RewritecWarning naming the file (and rule), and results equal eager.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import rewritec
import rewritec.compiler
import rewritec.runtime.wrapper
import torch
from rewritec.compiler import RewritecWarning
from rewritec.engine.errors import RuleError, RuleErrors
from rewritec.engine.rules import RuleLoader
from rewritec.kinds.registry import RULE_KINDS
from rewritec.rulecheck import rule_report
from rewritec.opcheck import check_ops
from rewritec.rulesets import builtin_rules, load_rule_files, user_ops

BAD_DIR = Path(__file__).resolve().parent / "bad_rules"
REPO_ROOT = BAD_DIR.parent.parent
CASES = sorted(p.stem for p in BAD_DIR.glob("*.yaml"))
CHECKED = ("loop_", "unsound_", "wrong_op_")  # found by running examples, not by loading
REGEN = os.environ.get("REGEN", "") not in ("", "0")

# Cases whose .expected is the message rewritec should give but does not yet,
# each with what the engine should do (empty: every case passes today).
XFAIL: dict[str, str] = {}

# Cases that still reach code generation when compiled with (empty today).
COMPILE_XFAIL: dict[str, str] = {}


def _norm(text: str) -> str:
    """Absolute paths -> repository-relative, as in the .expected files."""
    return text.replace(str(REPO_ROOT) + os.sep, "").rstrip("\n")


def _rel(name: str) -> str:
    return f"tests/bad_rules/{name}.yaml"


def _check_problems(path: Path) -> str:
    """The problem lines `rewritec rules check --rules PATH` prints for the file's
    own rules (the whole library is the loop-check context, as in the CLI)."""
    # What `rules check` sees: the library plus this file, before the per-compile
    # verification (rulesets.verify_user_rules) that would reject it outright.
    library = list(builtin_rules()) + RuleLoader(kernels=RULE_KINDS).load_file(path)
    rel = str(path.relative_to(REPO_ROOT))
    lines = []
    for rule in library:
        if rule.where.file != rel:
            continue
        problems, _ = rule_report(rule, library)
        lines += [f"{rule.location}: [{rule.name}] {p}" for p in problems]
    return "\n".join(lines) or "(rules check finds no problem)"


def _op_problems(path: Path) -> str:
    """The problem lines `rewritec rules check --rules PATH` prints for the file's ops."""
    _, table = load_rule_files([path])
    out = io.StringIO()
    check_ops(user_ops(table), table, list(builtin_rules()), out)
    lines = [line.strip() for line in out.getvalue().splitlines()
             if line.startswith("     ")]
    return "\n".join(lines) or "(rules check finds no problem)"


def produce(name: str) -> str:
    path = BAD_DIR / f"{name}.yaml"
    if name.startswith("wrong_op_"):
        return _norm(_op_problems(path))
    if name.startswith(CHECKED):
        return _norm(_check_problems(path))
    try:
        load_rule_files([path])
    except (RuleError, RuleErrors) as e:
        return _norm(str(e))
    return "(the file loads without an error)"


def _marked(cases: list[str], xfails: dict[str, str]) -> list:
    return [pytest.param(c, marks=pytest.mark.xfail(reason=xfails[c], strict=True))
            if c in xfails else c for c in cases]


def test_corpus_is_complete() -> None:
    assert len(CASES) >= 25
    for name in CASES:
        assert (BAD_DIR / f"{name}.expected").is_file(), f"{name}.yaml has no .expected"
    assert set(XFAIL) <= set(CASES) and set(COMPILE_XFAIL) <= set(CASES)
    orphans = {p.stem for p in BAD_DIR.glob("*.expected")} - set(CASES)
    assert not orphans, f".expected files without a .yaml: {sorted(orphans)}"


@pytest.mark.parametrize("name", _marked(CASES, XFAIL))
def test_error_message(name: str) -> None:
    got = produce(name)
    golden = BAD_DIR / f"{name}.expected"
    if REGEN and name not in XFAIL:
        golden.write_text(got + "\n")
    want = golden.read_text().rstrip("\n")
    assert "Traceback" not in got
    assert got == want


@pytest.mark.parametrize("name", CASES)
def test_expected_names_file_line_and_rule(name: str) -> None:
    """Each golden line starts with `tests/bad_rules/NAME.yaml:LINE`; where the
    rule's name is valid, `[name]` follows."""
    for line in (BAD_DIR / f"{name}.expected").read_text().rstrip("\n").splitlines():
        # a template's problem is at its line in the template, naming the rule's file
        if name.startswith("template_"):
            assert re.match(r"tests/bad_rules/templates/\S+:\d+: ", line), line
            assert _rel(name) in line, line
        else:
            assert re.match(rf"{re.escape(_rel(name))}:\d+(:\d+)?: ", line), line
        # errors about the file, not a rule: YAML syntax and structure, the file's kind
        if not name.startswith(("yaml_bad_indent", "yaml_tab", "yaml_unclosed", "yaml_alias",
                                "yaml_deep", "bad_name", "file_")):
            assert re.match(r"\S+: \[[a-z][a-z0-9_-]*\] ", line), line


def _tiny(x: torch.Tensor) -> torch.Tensor:
    # relu / * 2.0 / sin / gelu: the ops the loop, unsound and injection cases rewrite.
    y = torch.relu(x) * 2.0
    return torch.sin(y) + torch.nn.functional.gelu(x)


@pytest.mark.parametrize("name", _marked(CASES, COMPILE_XFAIL))
def test_compile_falls_back_before_codegen(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lowered: list[str] = []

    def no_lower(graph, bridge, gname, *args, **kwargs):
        lowered.append(gname)
        raise AssertionError(f"code generation reached for {gname}")

    # compiler.py binds `lower` at import: patch both names.
    monkeypatch.setattr(rewritec.compiler, "lower", no_lower)
    monkeypatch.setattr(rewritec.runtime.wrapper, "lower", no_lower)
    compiled = rewritec.compile(_tiny, rules=[str(BAD_DIR / f"{name}.yaml")])
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
    torch.testing.assert_close(got, _tiny(x))
    assert not lowered, f"{name}: code generation reached for {lowered}"
    messages = _norm("\n".join(str(w.message) for w in caught
                               if issubclass(w.category, RewritecWarning)))
    assert messages, f"{name}: no RewritecWarning"
    assert _rel(name) in messages, messages
    golden = (BAD_DIR / f"{name}.expected").read_text()
    for rule in set(re.findall(r": \[([A-Za-z][A-Za-z0-9_-]*)\] ", golden)):
        assert f"[{rule}]" in messages or f"{rule} (" in messages, (rule, messages)


SNAKE_RULE = """\
kind: simplify
rules:
  - name: add_self_Twice
    doc: "x + x -> x * 2"
    pattern: x + x
    replace: x * 2.0
    where:
      - is_float(x)
    examples: [{x: 4x8xf32}]
"""


def test_snake_case_rule_name_loads_and_fires(tmp_path: Path) -> None:
    """Rule names may use '_' and capitals, as a user's own naming does; only the
    characters that could reach generated code or a path are refused (bad_name_*)."""
    from rewritec.testing import assert_fires

    path = tmp_path / "snake.yaml"
    path.write_text(SNAKE_RULE)
    assert [r.name for r in RuleLoader(kernels=RULE_KINDS).load_file(path)] == ["add_self_Twice"]
    assert_fires("add_self_Twice", lambda x: (x + x).sin(), torch.randn(8), rules=[str(path)])
    with pytest.raises((RuleError, RuleErrors), match="rule name must be"):  # no newline
        bad = tmp_path / "newline.yaml"
        bad.write_text(SNAKE_RULE.replace("name: add_self_Twice", 'name: "add_self\\n"'))
        RuleLoader(kernels=RULE_KINDS).load_file(bad)


def test_python_tag_runs_nothing() -> None:
    """The python-tag files and the Python in an op's expression name a command;
    loading them must never run it."""
    marker = Path("/tmp/rewritec_pwned")
    marker.unlink(missing_ok=True)
    for name in ("yaml_python_tag", "yaml_python_name_tag", "op_triton_python"):
        with pytest.raises((RuleError, RuleErrors)):
            RuleLoader(kernels=RULE_KINDS).load_file(BAD_DIR / f"{name}.yaml")
    assert not marker.exists()


# ------------------------------------------------------------------ the real CLI (2 runs)
CLI = [sys.executable, "-m", "rewritec.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_cli_load_error_exits_2_with_the_golden_text() -> None:
    res = _cli("rules", "check", "--rules", _rel("two_errors"))
    want = (BAD_DIR / "two_errors.expected").read_text().rstrip("\n")
    assert res.returncode == 2, res
    assert "Traceback" not in res.stdout + res.stderr
    assert res.stderr.rstrip("\n") == f"rewritec: error: {want}"
    assert res.stdout == ""


def test_cli_rules_check_reports_the_loop() -> None:
    res = _cli("rules", "check", "--rules", _rel("loop_pair"))
    assert res.returncode == 1, res
    assert "Traceback" not in res.stdout + res.stderr
    lines = {line.strip() for line in res.stdout.splitlines()}
    for want in (BAD_DIR / "loop_pair.expected").read_text().rstrip("\n").splitlines():
        assert want in lines, f"missing from `rules check`:\n{want}\n--- got\n{res.stdout}"
