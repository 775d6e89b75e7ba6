"""A cache that someone else could have written is never trusted
(runtime/disk_cache.py): entries are signed with a per-user key and unpickled
with a fixed table of names; a folder or file of another user's, or writable by
others, is not used; an unusable folder or a compiler that never returns costs
a warning and some speed, never the compilation or a wrong answer."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import stat
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rewritec import report, rulesets
from rewritec.runtime import build, disk_cache
from rewritec.runtime.disk_cache import CacheWarning
from rewritec.runtime.launch import KernelFallback
from rewritec.runtime import graph_cache

pytestmark = pytest.mark.skipif(build.cxx() is None, reason="no C++ compiler")


def _norm_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(torch.sin(x) * 2 + 1, (x.shape[-1],), w)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REWRITEC_GRAPH_CACHE", "1")
    monkeypatch.setattr(disk_cache, "_unusable", {})  # each test may warn afresh
    disk_cache._private.cache_clear()  # and has a private folder of its own
    yield tmp_path / "cache"
    disk_cache._private.cache_clear()


def _compile(x: torch.Tensor, w: torch.Tensor, **options) -> torch.Tensor:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(_norm_chain, backend="rewritec",
                            options={"target": "openmp", **options})(x, w)
    torch.testing.assert_close(out, _norm_chain(x, w))
    return out


def _stored_entry(cache: Path) -> Path:
    x, w = torch.randn(4, 8), torch.randn(8)
    _compile(x, w)
    (entry,) = sorted((cache / "graphs").glob("*.pkl"))
    return entry


def _sign(path: Path, data: bytes, target: str = "") -> None:
    """Write `data` at `path` with a digest made with this user's key, as if whoever
    wrote it had the key too (the unpickler must still refuse what it names)."""
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(disk_cache._record(path.name, data, target))


def _rehash(path: Path, data: bytes) -> None:
    """Write `data` at `path` with its plain sha256 beside it: what anyone who can
    write the folder can do without the key."""
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(disk_cache.sha(data))


class _Eval:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (builtins.eval, (self.code,))


class _EvalPickler(pickle.Pickler):
    """Writes builtins.eval as the persistent id ("fn", "builtins", "eval")."""

    def persistent_id(self, obj):  # type: ignore[no-untyped-def]
        return ("fn", "builtins", "eval") if obj is builtins.eval else None


def _poison(marker: Path) -> bytes:
    buf = io.BytesIO()
    _EvalPickler(buf).dump({"name": _Eval(f"open({str(marker)!r}, 'w').close()")})
    return buf.getvalue()


# ----------------------------------------------------------------- graph entries


@pytest.mark.parametrize("digest", [_sign, _rehash])
def test_an_entry_calling_eval_is_refused(cache, aot_calls, tmp_path, digest) -> None:
    entry = _stored_entry(cache)
    marker = tmp_path / "pwned"
    digest(entry, _poison(marker))
    _compile(torch.randn(4, 8), torch.randn(8))
    assert not marker.exists()
    assert len(aot_calls) == 2  # a miss: compiled again


@pytest.mark.parametrize("kind", [("torch", "load"), ("packet", "import_module::x"),
                                  ("op", "load_library", "x", "y")])
def test_references_resolve_only_to_their_own_kind(kind) -> None:
    with pytest.raises(pickle.UnpicklingError):
        graph_cache._Unpickler(io.BytesIO(pickle.dumps(0))).persistent_load(kind)


def test_a_tampered_wrapper_source_is_not_run(cache, aot_calls, tmp_path) -> None:
    entry = _stored_entry(cache)
    marker = tmp_path / "pwned"
    record = graph_cache._Unpickler(io.BytesIO(entry.read_bytes())).load()
    record["source"] = f"open({str(marker)!r}, 'w').close()\n" + record["source"]
    buf = io.BytesIO()
    graph_cache._Pickler(buf).dump(record)
    _rehash(entry, buf.getvalue())
    _compile(torch.randn(4, 8), torch.randn(8))
    assert not marker.exists() and len(aot_calls) == 2


def test_an_entry_signed_with_another_key_is_refused(cache, aot_calls, tmp_path,
                                                     monkeypatch) -> None:
    entry = _stored_entry(cache)
    own = os.environ["REWRITEC_KEY_FILE"]
    monkeypatch.setenv("REWRITEC_KEY_FILE", str(tmp_path / "other-user" / "cache.key"))
    _sign(entry, entry.read_bytes())  # the other user's signature
    monkeypatch.setenv("REWRITEC_KEY_FILE", own)
    _compile(torch.randn(4, 8), torch.randn(8))
    assert len(aot_calls) == 2


@pytest.mark.parametrize("damage", ["truncated entry", "truncated digest", "symlinked entry"])
def test_damaged_or_linked_entries_are_misses(cache, aot_calls, tmp_path, damage) -> None:
    entry = _stored_entry(cache)
    digest = entry.with_name(entry.name + ".sha256")
    if damage == "truncated entry":
        entry.write_bytes(entry.read_bytes()[:40])
    elif damage == "truncated digest":
        digest.write_text(digest.read_text()[:70])
    else:  # a link to a file with the right bytes, elsewhere
        elsewhere = tmp_path / "elsewhere.pkl"
        elsewhere.write_bytes(entry.read_bytes())
        entry.unlink()
        entry.symlink_to(elsewhere)
    _compile(torch.randn(4, 8), torch.randn(8))
    assert len(aot_calls) == 2


def _foreign_owner(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    try:
        os.chown(path, 65534, 65534)
    except OSError as e:
        pytest.skip(f"cannot chown: {e}")


def test_an_entry_owned_by_another_user_is_a_miss(cache, aot_calls) -> None:
    entry = _stored_entry(cache)
    _foreign_owner(entry)
    _compile(torch.randn(4, 8), torch.randn(8))
    assert len(aot_calls) == 2


# ----------------------------------------------------------------- the folder


def _unused_folder(cache: Path, aot_calls: list[int], make_bad) -> None:  # type: ignore[no-untyped-def]
    """Store an entry, make the folder unusable, compile twice: the folder is left
    as it was, one warning says so, and both compiles are correct misses."""
    _stored_entry(cache)
    make_bad(cache)
    before = os.lstat(cache)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compile(torch.randn(4, 8), torch.randn(8))
        _compile(torch.randn(4, 8), torch.randn(8))
    said = [w for w in seen if issubclass(w.category, CacheWarning)]
    assert len(said) == 1 and str(cache) in str(said[0].message), [str(w.message) for w in seen]
    assert "\n" not in str(said[0].message)
    assert not [w for w in seen if issubclass(w.category, KernelFallback)]
    after = os.lstat(cache)
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    # the stored entry is not loaded; the second compile's is, from the private folder
    assert len(aot_calls) == 2
    assert all(r.status == "compiled" and r.kernels for r in report.RECORDS[1:])


def test_a_folder_owned_by_another_user_is_not_used(cache, aot_calls) -> None:
    _unused_folder(cache, aot_calls, _foreign_owner)


def test_a_group_writable_folder_is_not_used(cache, aot_calls) -> None:
    _unused_folder(cache, aot_calls, lambda p: p.chmod(0o770))


def test_a_read_only_folder_is_not_used_nor_chmoded(cache, aot_calls) -> None:
    _unused_folder(cache, aot_calls, lambda p: p.chmod(0o555))


@pytest.mark.parametrize("thing", ["dangling link", "file"])
def test_a_folder_that_is_not_one_compiles_without_it(cache, aot_calls, thing) -> None:
    def replace(p: Path) -> None:
        os.rename(p, p.with_name("moved"))
        if thing == "file":
            p.write_text("not a folder")
        else:
            p.symlink_to(p.with_name("nowhere"))

    _unused_folder(cache, aot_calls, replace)


def _stub_compiler(tmp_path: Path, body: str) -> Path:
    stub = tmp_path / "stub-c++"
    stub.write_text("#!/bin/sh\n"
                    'if [ "$1" = --version ]; then echo "stub 1.0"; exit 0; fi\n' + body)
    stub.chmod(0o755)
    return stub


def test_a_full_disk_builds_in_a_private_folder(cache, tmp_path, monkeypatch) -> None:
    real = build.cxx()
    stub = _stub_compiler(tmp_path, f'case "$*" in *{cache}/*) '
                          'echo "fatal error: No space left on device" >&2; exit 1;; esac\n'
                          f'exec {real} "$@"\n')
    monkeypatch.setenv("CXX", str(stub))
    build.cxx.cache_clear()
    try:
        with pytest.warns(CacheWarning, match="No space left on device"):
            fn, src = build.build_cpp(f'extern "C" int a() {{ return 3; }} // {uuid.uuid4()}\n',
                                      "a")
    finally:
        build.cxx.cache_clear()
    assert fn() == 3 and cache not in src.parents
    assert not [p for p in cache.iterdir() if p.suffix in (".so", ".cpp")], "files left behind"


def test_a_write_cut_short_leaves_no_temporary_file(cache, monkeypatch) -> None:
    import errno

    class Full(io.BytesIO):
        def write(self, data):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device")

    disk_cache.cache_dir()
    monkeypatch.setattr(disk_cache.os, "fdopen", lambda fd, mode: (os.close(fd), Full())[1])
    with pytest.raises(OSError, match="No space"):
        disk_cache.store(cache / "entry.pkl", b"data")
    assert not list(cache.iterdir())


def test_a_compiler_that_never_returns_spends_the_budget_once(cache, tmp_path,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("CXX", str(_stub_compiler(tmp_path, "exec sleep 600\n")))
    build.cxx.cache_clear()
    x = torch.randn(6, 11)

    def fn(x: torch.Tensor) -> torch.Tensor:  # three kernels' worth of groups
        return torch.softmax(x, -1) * 2 + torch.relu(x).sum(-1, keepdim=True) + x.amax()

    start = time.monotonic()
    try:
        with pytest.warns(KernelFallback, match="compile budget"):
            torch._dynamo.reset()
            got = torch.compile(fn, backend="rewritec",
                                options={"target": "openmp", "compile_budget": 2})(x)
    finally:
        build.cxx.cache_clear()
    assert time.monotonic() - start < 30
    torch.testing.assert_close(got, fn(x))
    assert [r.status for r in report.RECORDS] == ["compiled"]


def test_the_budget_comes_from_the_environment(monkeypatch) -> None:
    from rewritec.options import Options

    monkeypatch.setenv("REWRITEC_COMPILE_BUDGET", "7.5")
    assert Options.make().compile_budget == 7.5


# ----------------------------------------------------------------- kernels and key


def test_a_library_built_for_another_cpu_is_not_loaded(cache, monkeypatch) -> None:
    source = f'extern "C" int a() {{ return 5; }} // {uuid.uuid4()}\n'
    this_cpu = build.target
    monkeypatch.setattr(build, "target", lambda: "another-cpu")
    build.build_cpp(source, "a")
    [lib] = cache.glob("*.so")
    monkeypatch.setattr(build, "target", this_cpu)
    assert not build._verified(lib)  # recorded for another target
    fn, _ = build.build_cpp(source, "a")  # this CPU's key: built again
    assert fn() == 5 and len(list(cache.glob("*.so"))) == 2


def test_a_symlinked_library_is_rebuilt(cache, tmp_path) -> None:
    source = f'extern "C" int a() {{ return 6; }} // {uuid.uuid4()}\n'
    build.build_cpp(source, "a")
    [lib] = cache.glob("*.so")
    elsewhere = tmp_path / "lib.so"
    elsewhere.write_bytes(lib.read_bytes())
    lib.unlink()
    lib.symlink_to(elsewhere)
    assert not build._verified(lib)
    build.build_cpp(source, "a")
    assert not lib.is_symlink() and build._verified(lib)


def test_the_key_is_private_and_a_shared_one_is_refused(cache, tmp_path, monkeypatch) -> None:
    key = tmp_path / "config" / "cache.key"
    monkeypatch.setenv("REWRITEC_KEY_FILE", str(key))
    assert disk_cache.cache_dir() == cache
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) >= 32
    other = tmp_path / "shared.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o644)
    monkeypatch.setenv("REWRITEC_KEY_FILE", str(other))
    with pytest.warns(CacheWarning, match="no private key"):
        assert disk_cache.cache_dir() != cache


# ----------------------------------------------------------------- the rule table


def test_a_rule_table_not_signed_by_this_user_is_parsed_again(tmp_path, monkeypatch) -> None:
    compiled = tmp_path / "__pycache__"
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rulesets, "COMPILED_DIR", compiled)
    rulesets._builtin.cache_clear()
    try:
        rulesets.builtin_rules()
        [table] = compiled.glob("rules-*.pickle")
        marker = tmp_path / "pwned"
        _rehash(table, pickle.dumps(_Eval(f"open({str(marker)!r}, 'w').close()")))
        rulesets._builtin.cache_clear()
        assert rulesets.builtin_rules()
        assert not marker.exists()
    finally:
        rulesets._builtin.cache_clear()


# ----------------------------------------------------------------- the command line


def test_an_output_folder_that_cannot_be_made_is_one_line_before_running(tmp_path) -> None:
    script = tmp_path / "script.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "a-file").write_text("")
    res = subprocess.run([sys.executable, "-m", "rewritec.cli", "compile", str(script),
                          "--out", str(tmp_path / "a-file" / "out")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 2 and not marker.exists(), res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "a-file" in lines[0] and "Traceback" not in res.stderr, lines
