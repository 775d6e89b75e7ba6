"""codegen/triton_startup.py: Triton's start-up runs on a thread that CUDA graphs
begin and kernel loads join; CPU graphs never begin it, and its failures never
reach the caller."""

from __future__ import annotations

import threading

import pytest
import rewritec
import torch
from rewritec.codegen import triton_startup


@pytest.fixture
def fresh(monkeypatch) -> None:
    monkeypatch.setattr(triton_startup, "_thread", None)


def test_start_runs_once_and_wait_joins(fresh, monkeypatch) -> None:
    calls = []
    release = threading.Event()

    def slow_warm() -> None:
        calls.append(1)
        release.wait(5)

    monkeypatch.setattr(triton_startup, "_warm", slow_warm)
    triton_startup.start()
    first = triton_startup._thread
    triton_startup.start()
    assert triton_startup._thread is first and first.is_alive()
    release.set()
    triton_startup.wait()
    assert not first.is_alive() and calls == [1]


def test_wait_without_start_returns() -> None:
    triton_startup.wait()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_start_up_is_swallowed(fresh, monkeypatch) -> None:
    def broken() -> None:
        raise RuntimeError("no driver")

    monkeypatch.setattr(triton_startup, "_start_up", broken)
    triton_startup.start()
    triton_startup.wait()
    assert not triton_startup._thread.is_alive()


def test_cpu_graphs_do_not_start_it(fresh) -> None:
    f = rewritec.compile(lambda x: torch.sin(x) + 1)
    x = torch.randn(8)
    torch.testing.assert_close(f(x), torch.sin(x) + 1)
    assert triton_startup._thread is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_start_it_and_kernels_run(fresh) -> None:
    f = rewritec.compile(lambda x: torch.sin(x) + 1)
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(f(x), torch.sin(x) + 1)
    assert triton_startup._thread is not None and not triton_startup._thread.is_alive()


def test_triton_key_is_a_fingerprint_that_changes_with_any_triton_file(tmp_path) -> None:
    """Triton's cache is keyed by the installed files' paths, sizes and modification
    times: an edited or an added file gives another key, as Triton's own hash would."""
    import os

    tree = tmp_path / "triton"
    for rel in ("runtime/cache.py", "_C/libtriton.so", "compiler/code_gen.py",
                "language/core.py", "backends/nvidia/driver.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    seen = [triton_startup.installed_fingerprint(tree, "3.6.0")]
    assert triton_startup.installed_fingerprint(tree, "3.6.0") == seen[0]
    assert triton_startup.installed_fingerprint(tree, "3.6.1") != seen[0]
    (tree / "language" / "core.py").write_text("edited, longer than before")
    seen.append(triton_startup.installed_fingerprint(tree, "3.6.0"))
    lib = tree / "_C" / "libtriton.so"
    os.utime(lib, ns=(lib.stat().st_atime_ns, lib.stat().st_mtime_ns + 1))  # same size
    seen.append(triton_startup.installed_fingerprint(tree, "3.6.0"))
    (tree / "compiler" / "new_pass.py").write_text("a new module")
    seen.append(triton_startup.installed_fingerprint(tree, "3.6.0"))
    assert len(set(seen)) == 4


def test_the_start_up_keys_tritons_cache_by_the_fingerprint(fresh, monkeypatch) -> None:
    from triton.runtime import cache

    monkeypatch.setattr(cache, "triton_key", cache.triton_key)  # restored afterwards
    try:
        triton_startup._start_up()
    except Exception:  # noqa: BLE001 - no GPU driver here: the key is set before it
        pass
    assert cache.triton_key().startswith("rewritec-") and len(cache.triton_key()) == 73
