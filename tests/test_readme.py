"""Every ```python block of README.md runs as printed.

A block may use `model` (the README's stand-in for the user's module) and
`my_rules/` (the rule folder of its walkthrough): each runs in a temporary
folder that holds both. A block that defines `test_*` functions has them run.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from test_cli import _readme_rule

REPO_ROOT = Path(__file__).resolve().parent.parent
# A fence may be indented, as it is inside a numbered list.
_PYTHON_BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def _python_blocks() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return [textwrap.dedent(m.group(2)) for m in _PYTHON_BLOCK.finditer(text)]


def test_readme_has_python_blocks() -> None:
    assert len(_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index: int, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code = _python_blocks()[index]
    (tmp_path / "my_rules").mkdir()
    (tmp_path / "my_rules" / "double.yaml").write_text(_readme_rule())
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    scope: dict[str, object] = {"model": model}
    exec(compile(code, f"README.md python block {index}", "exec"), scope)
    tests = [f for name, f in scope.items() if name.startswith("test_") and callable(f)]
    for test in tests:
        test()
    fast = scope.get("fast")
    if callable(fast):  # the compiled model runs and equals eager
        x = torch.randn(4, 8)
        torch.testing.assert_close(fast(x), model(x))
