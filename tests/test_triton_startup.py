"""runtime/triton_startup.py: Triton's start-up runs on a thread that CUDA graphs
begin and kernel loads join; CPU graphs never begin it, and its failures never
reach the caller."""

from __future__ import annotations

import threading

import pytest
import rewritec
import torch
from rewritec.runtime import triton_startup


@pytest.fixture
def fresh(monkeypatch) -> None:
    monkeypatch.setattr(triton_startup, "_thread", None)
    monkeypatch.setattr(triton_startup, "_deferred", False)


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
    # begun on its thread, or left to the first kernel that needs Triton here when
    # the compile worker (runtime/ahead.py) compiled them
    thread = triton_startup._thread
    assert (thread is not None and not thread.is_alive()) or triton_startup._deferred


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


def test_the_deferred_driver_builds_its_utility_module_only_when_used(monkeypatch) -> None:
    """The CUDA driver the start-up installs takes device, stream and capability
    from torch; Triton's C utility module (built with gcc on a fresh cache) is made
    at the first use of `utils`, once, and never by compiling alone."""
    pytest.importorskip("triton.backends.nvidia.driver")
    from triton.backends.nvidia import driver as nvidia

    built = []

    class FakeUtils:
        def __init__(self) -> None:
            built.append(self)

    monkeypatch.setattr(nvidia, "CudaUtils", FakeUtils)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    deferred = triton_startup._deferred_cuda_driver()
    assert isinstance(deferred, nvidia.CudaDriver) and built == []
    assert deferred.get_device_capability is torch.cuda.get_device_capability
    assert deferred.get_current_device is torch.cuda.current_device
    assert deferred.launcher_cls is nvidia.CudaLauncher and built == []
    assert deferred.utils is deferred.utils and len(built) == 1


def test_no_deferred_driver_without_a_cuda_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_startup._deferred_cuda_driver() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_cuda_compile_builds_no_triton_utility_module(tmp_path) -> None:
    """In a fresh process with fresh caches, compiling and running a CUDA graph
    leaves no `cuda_utils` module in Triton's cache: nothing waited for gcc."""
    import os
    import subprocess
    import sys

    script = ("import torch, rewritec\n"
              "f = rewritec.compile(lambda x: torch.sin(x) * 2 + 1)\n"
              "x = torch.randn(4096, device='cuda')\n"
              "torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)\n"
              "print('ran')\n")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               REWRITEC_CACHE_DIR=str(tmp_path / "rewritec"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-2000:]
    built = [p.name for p in (tmp_path / "triton").rglob("*") if "cuda_utils" in p.name]
    assert built == [], built
    assert list((tmp_path / "triton").rglob("*.cubin")), "no kernel was compiled by Triton"


def test_the_start_up_imports_what_tritons_first_compile_would() -> None:
    """Run in a fresh interpreter: the modules are imported by `_import_compiler`,
    not already by `import triton`, and every listed one that exists gets loaded."""
    import subprocess
    import sys

    script = ("import sys, triton\n"
              "from rewritec.runtime import triton_startup as s\n"
              "before = set(sys.modules)\n"
              "s._import_compiler()\n"
              "new = [m for m in s.COMPILER_MODULES if m in sys.modules and m not in before]\n"
              "print(','.join(new))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.strip().split(",")
    assert "triton.compiler.code_generator" in loaded, loaded
    assert "triton.language.extra.libdevice" in loaded, loaded
