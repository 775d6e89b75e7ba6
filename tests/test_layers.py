"""The import contract: each layer imports only the layers below it.

    engine/ <- options, report, coverage <- aten/ <- passes/, kinds/ <- runtime/
    <- htmlreport/ <- rulecheck, opcheck <- rulesets <- compiler <- frontend/ <- explain,
    testing <- cli

Every import counts, one inside a function too: a function-level import may save
start-up time, never dodge a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module may import its own layer and those before it.
LAYERS: list[set[str]] = [
    {"engine"},
    {"options", "report", "coverage"},
    {"aten"},
    {"passes", "kinds"},
    {"runtime"},
    {"htmlreport"},
    {"rulecheck", "opcheck"},
    {"rulesets"},
    {"compiler"},
    {"frontend"},
    {"explain", "testing"},
    {"cli"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _modules() -> list[Path]:
    files = [p for unit in RANK for p in (ROOT / unit).rglob("*.py")]
    return sorted(files + [ROOT / f"{unit}.py" for unit in RANK if (ROOT / f"{unit}.py").exists()])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module relative to the package root) for each rewritec import."""
    package = path.relative_to(ROOT).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            mod = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{mod}.{a.name}" if mod else a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rewritec."):
            found.append((node.lineno, node.module.removeprefix("rewritec.")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.removeprefix("rewritec."))
                      for a in node.names if a.name.startswith("rewritec.")]
    return found


def _unit(module: str) -> str | None:
    return module.split(".")[0] if module.split(".")[0] in RANK else None


def upward_imports() -> list[str]:
    bad = []
    for path in _modules():
        here = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for line, target in _imports(path):
            unit = _unit(target)
            if unit is not None and RANK[unit] > RANK[here]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({unit} is above"
                           f" {here})")
    return bad


def test_every_module_is_in_a_layer() -> None:
    top = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir()
                                                   if (p / "__init__.py").exists()}
    assert top - {"__init__", "tests", "benchmarks"} <= set(RANK)


def test_no_layer_imports_a_layer_above_it() -> None:
    assert upward_imports() == []


def test_engine_loads_no_torch() -> None:
    code = ("import sys, rewritec.engine.pipeline, rewritec.engine.rules, "
            "rewritec.engine.fuse; print(sorted(m for m in ('torch', 'numpy', 'sympy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert "torch" not in out.stdout, out.stdout


@pytest.mark.parametrize("unit", ["aten", "passes", "kinds", "runtime", "frontend"])
def test_folder_is_a_package(unit: str) -> None:
    assert (ROOT / unit / "__init__.py").exists()


def _kind_dispatches(path: Path, kinds: set[str]) -> list[str]:
    """Comparisons of something named kind or template with a kernel kind's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {c.value for s in sides for c in ast.walk(s)
                 if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        other = " ".join(ast.unparse(s) for s in sides if not isinstance(s, ast.Constant))
        if names & kinds and ("template" in other or "kind" in other):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_dispatch_on_a_kind_s_name_outside_kinds() -> None:
    """Issue 23: every question about a kernel goes to its kind (kinds/kind.py), never
    to a switch on its name: outside kinds/, nothing compares a kind or template name."""
    from rewritec.kinds.registry import KINDS

    outside = [p for p in _modules() if p.relative_to(ROOT).parts[0] != "kinds"]
    assert [d for p in outside for d in _kind_dispatches(p, set(KINDS))] == []
