"""Faults in code generation: each gives a warning and an ATen fallback for the
affected group, correct results and no crash, and the kernel cache recovers.
`strict` turns each fallback into an error."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import rewritec
from rewritec import report
from rewritec.runtime import build, launch
from rewritec.kinds import kernels
from rewritec.runtime.launch import KernelFallback

pytestmark = pytest.mark.skipif(build.cxx() is None, reason="no C++ compiler")


def fn(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1) * 2.0 + torch.relu(x)


def _run(**options):
    torch._dynamo.reset()
    report.reset()
    x = torch.randn(6, 11)
    got = rewritec.compile(fn, target="openmp", **options)(x)
    torch.testing.assert_close(got, fn(x))
    return [k for r in report.RECORDS for k in r.kernels]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_no_cpp_compiler_falls_back(monkeypatch, cache) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    build.cxx.cache_clear()
    try:
        with pytest.warns(KernelFallback, match=r"rule fuse-row @ rules/fuse/kernels.yaml:\d+ "
                          r"\(template openmp/row\).*no C\+\+ compiler"):
            assert _run() == []
        with pytest.raises(Exception, match="no C\\+\\+ compiler"):
            _run(strict=True)
        # With target auto, no compiler simply means no kernels, quietly.
        torch._dynamo.reset()
        x = torch.randn(3, 4)
        torch.testing.assert_close(rewritec.compile(fn, strict=True)(x), fn(x))
    finally:
        build.cxx.cache_clear()


def test_template_producing_invalid_code_falls_back(monkeypatch, cache) -> None:
    real = kernels.value_expr
    monkeypatch.setattr(kernels, "value_expr",
                        lambda *a, **k: real(*a, **k).replace("(", "((", 1) + " +* ")
    with pytest.warns(KernelFallback, match="rejected the kernel"):
        assert _run() == []
    with pytest.raises(Exception, match="rejected the kernel"):
        _run(strict=True)


def test_out_of_memory_at_launch_falls_back(monkeypatch, cache) -> None:
    def oom(self, *inputs):
        raise torch.OutOfMemoryError("simulated out of memory")

    monkeypatch.setattr(launch.CppLauncher, "launch", oom)
    with pytest.warns(KernelFallback, match="failed at launch.*simulated out of memory"):
        assert _run()  # kernels were built; the launch failed, ATen ran instead
    with pytest.raises(torch.OutOfMemoryError):
        _run(strict=True)


def _cached_libs(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.so"))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "swap"])
def test_damaged_cache_entry_is_rebuilt(cache, damage) -> None:
    source = f"extern \"C\" int answer() {{ return 42; }} // {uuid.uuid4()}\n"
    fn1, _ = build.build_cpp(source, "answer")
    fn1.restype = None
    [lib] = _cached_libs(cache)
    good = lib.read_bytes()

    def overwrite(data: bytes) -> None:
        # A new file over the old name: the library this process already mapped
        # stays intact (writing into a mapped .so in place would crash any process).
        tmp = lib.with_name("damaged.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, lib)

    if damage == "truncate":
        overwrite(good[:100])
    elif damage == "garbage":
        overwrite(b"\x7fELF" + os.urandom(len(good)))
    else:  # a valid library that is not the one the digest names
        other, _ = build.build_cpp(source.replace("42", "7"), "answer")
        os.replace(next(p for p in _cached_libs(cache) if p != lib), lib)
    damaged = lib.read_bytes()
    assert not build._verified(lib)
    build.build_cpp(source, "answer")
    rebuilt = lib.read_bytes()
    assert build._verified(lib) and rebuilt != damaged
    assert rebuilt[:4] == b"\x7fELF" and abs(len(rebuilt) - len(good)) < 256


def test_cache_folder_is_user_only(cache) -> None:
    build.build_cpp(f"extern \"C\" void f() {{}} // {uuid.uuid4()}\n", "f")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_two_processes_fill_the_cache_at_once(cache) -> None:
    source = f"extern \"C\" int answer() {{ return 42; }} // {uuid.uuid4()}\n"
    script = textwrap.dedent(f"""
        import ctypes
        from rewritec.runtime.build import build_cpp
        fn, _ = build_cpp({source!r}, "answer")
        fn.restype = ctypes.c_int
        assert fn() == 42
        print("ok")
    """)
    env = dict(os.environ, REWRITEC_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    [lib] = _cached_libs(cache)
    assert build._verified(lib)
    assert not list(cache.glob(".*")), "temporary files left behind"
