"""The on-disk cache's folder, and which of its files may be trusted.

Kernels (runtime/build.py), their Triton binaries (runtime/static_launch.py),
compiled graphs (runtime/graph_cache.py) and the rule table (rulesets.py) are
kept in `$REWRITEC_CACHE_DIR` (default `~/.cache/rewritec`). What is read back
from there is loaded as code, so:

- the folder is used only if it is a folder owned by this user and writable by
  no one else (it is created 0700 and never chmod'ed); otherwise, or when it
  cannot be written (read-only, full disk, a dangling link or a file in its
  place), kernels are built in a private temporary folder for this process,
  after one `CacheWarning`;
- each artifact has a digest file beside it: its sha256, the target it was
  built for, and an HMAC of both under a per-user key kept outside the cache
  (`$REWRITEC_KEY_FILE`, default `$XDG_CONFIG_HOME/rewritec/cache.key`, 0600).
  An artifact is read only through `read_verified`, which refuses a symlink, a
  file owned by someone else or writable by group or others, bytes that do not
  match the hash, another target, or a tag made without this user's key. The
  HMAC covers a 64-byte digest that is computed anyway, so a warm load pays
  microseconds for it.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from ..engine.diag import user_stacklevel

# The lock publish() holds: fcntl on POSIX, msvcrt on Windows, else neither.
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None  # type: ignore[assignment]

KEY_BYTES = 32


class CacheWarning(UserWarning):
    """The cache folder is not used; kernels are built in a private folder."""


def configured_root() -> Path:
    return Path(os.environ.get("REWRITEC_CACHE_DIR") or Path.home() / ".cache" / "rewritec")


def key_path() -> Path:
    given = os.environ.get("REWRITEC_KEY_FILE")
    if given:
        return Path(given)
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "rewritec" / "cache.key"


# ---------------------------------------------------------------- the folder

_unusable: dict[str, str] = {}  # folder -> why it is not used (said once)


def folder_problem(path: Path, create: bool = True) -> str | None:
    """Why `path` cannot be trusted as a cache folder, or None. A missing folder
    is created 0700 (with its parents) when `create`."""
    try:
        if create and not os.path.lexists(path):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(path)  # a link to a folder of this user's is followed
    except FileNotFoundError:
        return "it is a dangling link" if os.path.islink(path) else "it does not exist"
    except OSError as e:
        return e.strerror or str(e)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if not st.st_mode & 0o200 or not os.access(path, os.W_OK | os.X_OK):
        return f"it is read-only (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_dir() -> Path:
    """The cache folder, or this process's private one where it cannot be used."""
    root = configured_root()
    why = _unusable.get(str(root))
    if why is None:
        why = folder_problem(root) or _key_problem()
        if why is None:
            return root
    return give_up(root, why)


def give_up(root: Path, why: str) -> Path:
    """Stop using `root` in this process (saying why, once); the private folder."""
    if str(root) not in _unusable:
        _unusable[str(root)] = why
        warnings.warn(f"rewritec: cache folder {root} is not used: {why}; compiling "
                      f"without it, in a private temporary folder", CacheWarning,
                      stacklevel=user_stacklevel())
    return _private()


@cache
def _private() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rewritec-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def subdir(name: str) -> Path:
    """A folder inside the cache, under the same conditions as the cache itself."""
    path = cache_dir() / name
    why = folder_problem(path)
    if why is not None:
        raise OSError(f"cache folder {path}: {why}")
    return path


# ---------------------------------------------------------------- the key

def _key_problem() -> str | None:
    return None if _key(str(key_path()))[1] else f"no private key at {key_path()}"


def secret() -> bytes:
    """This user's key; a random one for this process where it has none."""
    return _key(str(key_path()))[0]


@cache
def _key(path_text: str) -> tuple[bytes, bool]:
    """(key, whether it is the user's lasting one)."""
    path = Path(path_text)
    try:
        return _read_key(path), True
    except FileNotFoundError:
        pass
    except OSError:
        return os.urandom(KEY_BYTES), False
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".cache.key.", dir=path.parent)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
        try:
            os.link(tmp, path)  # fails if another process made one first: use that
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return _read_key(path), True
    except OSError:
        return os.urandom(KEY_BYTES), False


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path} is not private to this user")
        data = f.read()
    if len(data) < KEY_BYTES:
        raise PermissionError(f"{path} is too short")
    return data


# ---------------------------------------------------------------- the artifacts


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tag(name: str, digest: str, target: str) -> str:
    return hmac.new(secret(), f"{name}\0{digest}\0{target}".encode(), hashlib.sha256).hexdigest()


def _record(name: str, data: bytes, target: str) -> str:
    digest = sha(data)
    return f"{digest} {target or '-'} {_tag(name, digest, target)}\n"


def _read_own(path: Path) -> bytes:
    """A regular file of this user's that no one else can write (no link followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{path} is not this user's own file")
        return f.read()


def read_verified(path: Path, target: str = "") -> bytes | None:
    """The artifact's bytes if its digest file vouches for them (this user's key,
    this target), else None."""
    try:
        data = _read_own(path)
        recorded = _read_own(path.with_name(path.name + ".sha256")).decode().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(recorded) != 3 or recorded[1] != (target or "-"):
        return None
    digest = sha(data)
    if not hmac.compare_digest(recorded[0], digest) or not hmac.compare_digest(
            recorded[2], _tag(path.name, digest, target)):
        return None
    return data


def verified(path: Path, target: str = "") -> bool:
    return read_verified(path, target) is not None


def publish(tmp: Path, path: Path, target: str = "") -> None:
    """Move a finished artifact and its digest into place. Two processes building the
    same entry at once each hold the entry's lock in turn; the second finds it
    published and keeps it (their bytes may differ: the compiler records the
    temporary file names), so an artifact never meets the other's digest. The
    temporary file is gone afterwards, whatever happens."""
    digest_tmp = tmp.with_name(tmp.name + ".sha256")
    try:
        with locked(path.with_name(path.name + ".lock")):
            if verified(path, target):
                return
            digest_tmp.write_text(_record(path.name, tmp.read_bytes(), target))
            os.replace(tmp, path)
            os.replace(digest_tmp, path.with_name(path.name + ".sha256"))
    finally:
        tmp.unlink(missing_ok=True)
        digest_tmp.unlink(missing_ok=True)


# How long an O_EXCL lock file (no fcntl, no msvcrt) may stand before it is
# taken for one a crashed process left behind.
LOCK_STALE_S = 60.0


@contextmanager
def locked(lock: Path) -> Iterator[None]:
    """Hold the lock file `lock` exclusively: fcntl.flock on POSIX, msvcrt.locking
    on Windows, else a lock file made with O_EXCL (`lock` + "x")."""
    if fcntl is not None:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            yield
        return
    if msvcrt is not None:
        with open(lock, "a+b") as held:
            _msvcrt_lock(held.fileno())
            try:
                yield
            finally:
                held.seek(0)
                msvcrt.locking(held.fileno(), msvcrt.LK_UNLCK, 1)
        return
    with _exclusive_file(lock.with_name(lock.name + "x")):
        yield


def _msvcrt_lock(fd: int) -> None:
    """msvcrt.locking's LK_LOCK gives up after ten seconds: wait on."""
    while True:
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # type: ignore[attr-defined,union-attr]
            return
        except OSError:
            continue


@contextmanager
def _exclusive_file(lock: Path) -> Iterator[None]:
    """Hold `lock` by creating it (O_EXCL: one creator wins) and removing it after;
    one older than LOCK_STALE_S is a dead holder's and is removed."""
    while True:
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            break
        except FileExistsError:
            try:
                stale = time.time() - lock.stat().st_mtime > LOCK_STALE_S
            except FileNotFoundError:
                continue  # released meanwhile
            if stale:
                lock.unlink(missing_ok=True)
            else:
                time.sleep(0.02)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def store(path: Path, data: bytes, target: str = "") -> None:
    """Write `data` as the artifact `path` (through a temporary file beside it,
    removed if the write fails, on a full disk say) and publish it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(tmp)
        raise
    publish(Path(tmp), path, target)
