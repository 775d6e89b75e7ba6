"""The wheel: quiet to build, and it carries every rule file and template.

The repository root is the package, so rules/ and templates/ are folders of
data under it. A built wheel (not the editable install the tests run from)
is the only place a missing data file shows.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# What a build must not see: the virtual environment, old builds, outputs.
_NOT_SOURCE = shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     "rewritec_out", ".git", ".*_cache", ".hypothesis")


def _data_files() -> list[str]:
    """The package data of the checkout, as wheel paths."""
    files = [*REPO_ROOT.glob("rules/**/*.yaml"), *REPO_ROOT.glob("templates/**/*.j2"),
             *REPO_ROOT.glob("engine/*.lark"), *REPO_ROOT.glob("htmlreport/*.j2"),
             *REPO_ROOT.glob("htmlreport/*.css"), *REPO_ROOT.glob("htmlreport/*.js")]
    return sorted("rewritec/" + f.relative_to(REPO_ROOT).as_posix() for f in files)


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy, so the build neither writes into the checkout nor reads a stale build/.
    src = tmp / "src"
    shutil.copytree(REPO_ROOT, src, ignore=_NOT_SOURCE)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=120, check=False)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    (wheel,) = (tmp / "dist").glob("rewritec-*.whl")
    return wheel, log


def test_wheel_holds_every_rule_file_and_template(built_wheel: tuple[Path, str]) -> None:
    wheel, _ = built_wheel
    expected = _data_files()
    assert any(f.startswith("rewritec/rules/") for f in expected)
    assert any(f.startswith("rewritec/templates/") for f in expected)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in expected if f not in names]
    assert not missing, f"not in {wheel.name}: {missing}"


def test_wheel_build_is_quiet_about_data_folders(built_wheel: tuple[Path, str]) -> None:
    _, log = built_wheel
    assert "absent from the `packages` configuration" not in log, log[-4000:]
    assert "absent from" not in log, log[-4000:]
