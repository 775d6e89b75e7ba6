"""docs/fusion.md's worked example is true: a kind added the way it says works.

The module, the two templates and the rule are the blocks printed in the doc. The
module is loaded as `rewritec.kinds.flat` from a temporary folder and entered in
the registry (the doc's step 3, `KINDS`, with what kinds/registry.py derives from
it); the templates and the rule go into a user's rule folder. A program compiled
with that folder then runs one `flat` kernel, OpenMP on the CPU and Triton on the
GPU (under TRITON_INTERPRET=1 where there is none), equal to eager.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.engine.errors import RuleError, RuleErrors
from rewritec.kinds import registry
from rewritec.rulesets import load_rule_files

DOC = Path(__file__).resolve().parent.parent / "docs" / "fusion.md"


def _block(first_line: str) -> str:
    """The doc's code block whose first line is `first_line`, without that line."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", DOC.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if b.startswith(first_line + "\n")]
    return block[len(first_line) + 1:]


def _rule_file() -> str:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
                if "kernel: flat" in b]
    return "kind: fuse\nrules:\n" + block


def _load_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    path = tmp_path / "flat.py"
    path.write_text(_block("# kinds/flat.py"))
    spec = importlib.util.spec_from_file_location("rewritec.kinds.flat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rewritec.kinds.flat", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def flat_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kind registered, and a rule folder with its rule and templates."""
    kind = _load_module(tmp_path, monkeypatch).KIND
    monkeypatch.setitem(registry.KINDS, kind.name, kind)
    monkeypatch.setitem(registry.RULE_KINDS, kind.name, (kind.name,))
    monkeypatch.setitem(registry.SPACES, kind.name, kind.space)
    folder = tmp_path / "my_kind"
    for target, ext in (("triton", "py"), ("openmp", "cpp")):
        name = f"templates/{target}/flat.{ext}.j2"
        (folder / "templates" / target).mkdir(parents=True)
        (folder / name).write_text(_block("{# " + name + " #}"))
    (folder / "flat.yaml").write_text(_rule_file())
    return folder


def _device(target: str) -> str:
    """OpenMP on the CPU; Triton on the GPU, else its interpreter on the CPU."""
    if target == "openmp":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    return "cpu"


def test_the_rule_names_a_kind_the_registry_must_hold(tmp_path: Path) -> None:
    """Without step 3 the rule is a load error: the registry is what the loader asks."""
    (tmp_path / "flat.yaml").write_text(_rule_file())
    with pytest.raises((RuleError, RuleErrors), match="unknown kernel kind 'flat'"):
        load_rule_files([tmp_path / "flat.yaml"])


@pytest.mark.parametrize("target", ["openmp", "triton"])
def test_a_kind_added_as_the_doc_says_compiles_and_runs(target: str, flat_folder: Path) -> None:
    device = _device(target)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2.0 + y) - torch.sigmoid(y)

    x, y = torch.randn(37, 5, device=device), torch.randn(37, 5, device=device)
    torch._dynamo.reset()
    report.reset()
    with torch.no_grad():
        got = rewritec.compile(f, target=target, strict=True, graph_cache=False,
                               rules=[str(flat_folder)])(x, y)
    torch.testing.assert_close(got, f(x, y))
    ((kernel,),) = [r.kernels for r in report.RECORDS]
    assert (kernel["kind"], kernel["rules"]) == ("flat", ["fuse-flat"])
    ext = "py" if target == "triton" else "cpp"
    assert kernel["template"] == str((flat_folder / "templates" / target /
                                      f"flat.{ext}.j2").resolve())


def test_a_strided_input_is_refused_by_the_kind_s_legality_check(flat_folder: Path) -> None:
    """The render's check: a transposed input sends the group back to ATen."""
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.t() * 2.0 + y)

    x, y = torch.randn(5, 37), torch.randn(37, 5)
    torch._dynamo.reset()
    report.reset()
    with torch.no_grad(), pytest.warns(Warning, match="flat: an input is strided"):
        got = rewritec.compile(f, target="openmp", graph_cache=False,
                               rules=[str(flat_folder)])(x, y)
    torch.testing.assert_close(got, f(x, y))
    assert all(not r.kernels for r in report.RECORDS)
