"""Shared fixtures for the rewritec test suite.

Every test starts from a clean TorchDynamo cache, an empty compile report and a
fixed random seed, so tests neither see each other's compiled graphs nor
depend on the order they run in.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter.
# It must be chosen before triton is first imported (its own library functions
# are decorated at import time), so it is set here, not in a fixture.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Tests build kernels into a private cache, never the user's ~/.cache/rewritec.
os.environ.setdefault("REWRITEC_CACHE_DIR", tempfile.mkdtemp(prefix="rewritec-test-cache-"))
# ... and sign its entries with a key of their own, never the user's.
os.environ.setdefault("REWRITEC_KEY_FILE", os.path.join(
    tempfile.mkdtemp(prefix="rewritec-test-key-"), "cache.key"))
# Every test compiles: a graph another test stored would otherwise be loaded from the
# graph cache, skipping what the test checks. tests/test_graph_cache.py turns it on.
os.environ["REWRITEC_GRAPH_CACHE"] = "0"

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


@pytest.fixture
def aot_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the compilations that went through AOTAutograd (graph-cache misses)."""
    from rewritec.frontend import backend

    calls: list[int] = []
    real = backend._through_aot

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(backend, "_through_aot", counted)
    return calls


@pytest.fixture
def plans_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch plans (runtime/launch.py) learned and replayed on the CPU, where the
    tests' stand-in kernels run: on the GPU they are made for CUDA launches only."""
    from rewritec.runtime import launch

    monkeypatch.setattr(launch, "PLAN_DEVICE", "cpu")
    monkeypatch.setattr(launch, "_plan_device", lambda: -1)
    monkeypatch.setattr(launch, "_plan_alloc", lambda size, stride, dtype:
                        torch.empty_strided(size, stride, dtype=dtype))
