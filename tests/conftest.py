"""Shared fixtures for the rewritec test suite.

Every test starts from a clean TorchDynamo cache, an empty compile report and a
fixed random seed, so tests neither see each other's compiled graphs nor
depend on the order they run in.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# `from models import ...` must work whatever pytest's import mode is.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(autouse=True)
def _fresh_state():
    from rewritec import report

    torch._dynamo.reset()
    report.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
    report.reset()


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT
