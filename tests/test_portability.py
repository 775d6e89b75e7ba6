"""Machines without fcntl (Windows) or a compiler with OpenMP (macOS's clang):
the kernel cache still locks, and a compiler that rejects -fopenmp costs one
warning and single-threaded kernels, never a fallback for every graph."""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.runtime import build, disk_cache
from rewritec.runtime.build import NoOpenMPWarning
from rewritec.runtime.launch import KernelFallback


@pytest.fixture
def no_fcntl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_cache, "fcntl", None)
    monkeypatch.setattr(disk_cache, "msvcrt", None)


def test_the_cache_lock_without_fcntl_excludes(tmp_path: Path, no_fcntl: None) -> None:
    lock = tmp_path / "a.so.lock"
    order: list[str] = []
    held = threading.Event()

    def second() -> None:
        held.wait()
        with disk_cache.locked(lock):
            order.append("second")

    t = threading.Thread(target=second)
    t.start()
    with disk_cache.locked(lock):
        held.set()
        time.sleep(0.2)
        order.append("first")
    t.join(10)
    assert order == ["first", "second"]
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the lock


def test_a_stale_lock_file_is_taken_over(tmp_path: Path, no_fcntl: None) -> None:
    stale = tmp_path / "a.so.lockx"  # left by a process that died holding it
    stale.touch()
    old = time.time() - 2 * disk_cache.LOCK_STALE_S
    os.utime(stale, (old, old))
    with disk_cache.locked(tmp_path / "a.so.lock"):
        assert stale.exists()
    assert not stale.exists()


def test_the_cache_stores_without_fcntl(tmp_path: Path, no_fcntl: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    path = disk_cache.cache_dir() / "k.py"
    disk_cache.store(path, b"x = 1\n")
    assert disk_cache.read_verified(path) == b"x = 1\n"


def _reduce(x: torch.Tensor) -> torch.Tensor:  # a reduction kernel: the template uses omp.h
    return torch.softmax(x, dim=-1) * 2.0 + x.sum(0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_a_compiler_without_openmp_warns_once_and_builds(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    stub = tmp_path / "clang++"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do\n  if [ "$a" = -fopenmp ]; then\n'
                    '    echo "clang: error: unsupported option \'-fopenmp\'" >&2; exit 1\n'
                    '  fi\ndone\nexec g++ "$@"\n')
    stub.chmod(0o755)
    monkeypatch.setenv("CXX", str(stub))
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_openmp", {})
    monkeypatch.setattr(build, "_vector_math", None)
    build.cxx.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for shape in [(6, 11), (5, 7)]:  # two graphs
                torch._dynamo.reset()
                report.reset()
                x = torch.randn(*shape)
                got = rewritec.compile(_reduce, target="openmp", strict=True)(x)
                torch.testing.assert_close(got, _reduce(x))
                assert [r.status for r in report.RECORDS] == ["compiled"]
                assert report.RECORDS[0].kernels  # kernels built without OpenMP
    finally:
        build.cxx.cache_clear()
    omp = [w for w in seen if issubclass(w.category, NoOpenMPWarning)]
    assert len(omp) == 1 and "-fopenmp" in str(omp[0].message), [str(w.message) for w in seen]
    assert not [w for w in seen if issubclass(w.category, KernelFallback)]
