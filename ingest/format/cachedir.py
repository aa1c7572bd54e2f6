"""The on-disk layout of the node-wide shard cache: directories, locks, users, liveness.

A directory per user under the cache root, one per store in it named from the SHA-256 of
its manifest (which covers every shard's checksum): a rebuilt store never meets old copies::

    <cache root>/imfeed-cache-<uid>/   mode 0700, checked to be this user's
      <id>.lock                        flock: joining, leaving, removing <id>/
      <id>/store.json, session, keep   the store (for `ls`), this run's token (join()), keep
      <id>/users/<pid>-<start>         one empty file per process using the cache
      <id>/budget.lock, locks/shard-00000.lock    flock: reserving space; one copier a shard
      <id>/.tmp-shard-00000.<pid>-<start>/        a copy in progress, its owner in the name
      <id>/shard-00000/                a complete copy: data.mdb, copy.json, verified

Processes are named ``<pid>-<start time>`` (/proc tells a reused pid): what a process
killed at any point leaves, the next one recognises as dead and removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

DEFAULT_ROOT = "/dev/shm"
TMP_PREFIX = ".tmp-"
USERS, LOCKS, SESSION, KEEP, STORE_INFO = "users", "locks", "session", "keep", "store.json"


class CacheError(ValueError):
    """A cache root that cannot be used (missing, not a directory, someone else's)."""


def base_dir(cache_root: str | os.PathLike = DEFAULT_ROOT, create: bool = True) -> Path:
    """This user's directory of caches under ``cache_root``, made private (mode 0700).

    Raises:
        CacheError: ``cache_root`` is not a directory, or the directory is a symlink or
            belongs to another user (who could otherwise plant files we would read).
    """
    root = Path(cache_root)
    if not root.is_dir():
        raise CacheError(f"cache_root={str(root)!r} is not a directory; pass an existing one")
    path = base_path(root)
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid():
            raise CacheError(
                f"{path} is not a directory owned by you (uid {os.getuid()}); remove it or "
                "pass another cache_root"
            )
    return path


def base_path(cache_root: str | os.PathLike = DEFAULT_ROOT) -> Path:
    """Where ``base_dir`` is, unchecked."""
    return Path(cache_root) / f"imfeed-cache-{os.getuid()}"


def store_id(manifest_bytes: bytes) -> str:
    """The cache name of a store: a prefix of the SHA-256 of its manifest.json's bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()[:20]


# -- processes ------------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None when it is not running
    (or is a zombie, which will never touch the cache again)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def me() -> str:
    """This process's name in the cache: ``<pid>-<start time>``."""
    return f"{os.getpid()}-{start_time(os.getpid())}"


def alive(name: str) -> bool:
    """Whether the process named ``<pid>-<start time>`` (as ``me()`` gives) still runs."""
    pid, _, start = name.partition("-")
    try:
        return str(start_time(int(pid))) == start
    except ValueError:  # not a name of ours: treat as dead, so that it gets cleaned
        return False


def tmp_owner(name: str) -> str:
    """The owner of a temporary entry ``.tmp-<what>.<pid>-<start>``."""
    return name.rsplit(".", 1)[-1]


# -- locks ------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if needed). The kernel drops it when
    the holder dies, so a killed process never leaves a lock behind. A holder may delete
    the file; a waiter then finds that it locked an unlinked file and locks the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(path, fd):
                yield  # an error of the body is the caller's: never retried here
                return
        finally:
            os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{me()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -- users -------------------------------------------------------------------------------


def join(cache: Path, info: dict, keep: bool) -> str:
    """Register this process as a user of ``cache``; return the run's session token.

    A process that finds no live user starts a new run: it removes the entries of dead
    processes, draws a new session token (so every complete copy left by an earlier run
    is verified again before its first use) and forgets an earlier run's ``keep``.
    """
    with locked(cache.with_name(cache.name + ".lock")):
        (cache / USERS).mkdir(parents=True, exist_ok=True)
        (cache / LOCKS).mkdir(exist_ok=True)
        live = prune(cache)
        if not live or not (cache / SESSION).is_file():
            write_atomic(cache / STORE_INFO, json.dumps(info))
            write_atomic(cache / SESSION, secrets.token_hex(8))
            (cache / KEEP).unlink(missing_ok=True)
        if keep:
            (cache / KEEP).touch()
        (cache / USERS / me()).touch()
        return (cache / SESSION).read_text(encoding="utf-8")


def leave(cache: Path, name: str) -> bool:
    """Unregister user ``name``; the last one out removes the cache unless a user of this
    run asked to keep it. Returns whether the cache was removed."""
    if not cache.parent.is_dir():  # this user's caches all removed (by hand): nothing to leave
        return True
    with locked(cache.with_name(cache.name + ".lock")):
        (cache / USERS / name).unlink(missing_ok=True)
        if cache.is_dir() and (prune(cache) or (cache / KEEP).exists()):
            return False
        shutil.rmtree(cache, ignore_errors=True)
        cache.with_name(cache.name + ".lock").unlink(missing_ok=True)
        return True


def prune(cache: Path) -> list[str]:
    """Remove the user files and temporary copies of dead processes; return live users."""
    live = []
    for entry in _list(cache / USERS):
        if alive(entry.name):
            live.append(entry.name)
        else:
            entry.unlink(missing_ok=True)
    for entry in _list(cache):
        if not entry.name.startswith(TMP_PREFIX) or alive(tmp_owner(entry.name)):
            continue
        if not entry.name.startswith(TMP_PREFIX + "shard-"):
            remove(entry)  # a small file written under the lock we hold
            continue
        shard = entry.name[len(TMP_PREFIX) :].rsplit(".", 1)[0]
        with _try_locked(cache / LOCKS / f"{shard}.lock") as mine:
            if mine:  # nobody copies that shard: the copy is abandoned for sure
                remove(entry)
    return live


@contextlib.contextmanager
def _try_locked(path: Path) -> Iterator[bool]:
    """Hold the flock on ``path`` if it is free now; yields whether it is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _list(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


# -- ls and clear -----------------------------------------------------------------------------


def describe(cache: Path) -> dict:
    """What ``ingest cache ls`` shows of one store's cache."""
    try:
        info = json.loads((cache / STORE_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    shards = [p for p in _list(cache) if p.name.startswith("shard-") and p.is_dir()]
    tmps = [p for p in _list(cache) if p.name.startswith(TMP_PREFIX + "shard-")]
    return {
        "id": cache.name,
        "store": info.get("store"),
        "shards": len(shards),
        "store_shards": info.get("shards"),
        "bytes": sum(file_size(p / "data.mdb") for p in shards),
        "keep": (cache / KEEP).exists(),
        "stale": _stale(info.get("store"), cache.name),
        "users": {p.name: alive(p.name) for p in _list(cache / USERS)},
        "copying": {p.name: alive(tmp_owner(p.name)) for p in tmps},
    }


def _stale(store: str | None, ident: str) -> bool:
    """Whether the store a cache was made from is gone or was rebuilt since."""
    try:
        return store_id((Path(store) / "manifest.json").read_bytes()) != ident
    except (OSError, TypeError):
        return True


def list_caches(cache_root: str | os.PathLike = DEFAULT_ROOT) -> list[dict]:
    """Every store cache of this user under ``cache_root``, as ``describe`` gives them."""
    base = base_dir(cache_root, create=False)
    return [describe(p) for p in _list(base) if p.is_dir() and not p.name.startswith(".")]


def clear(cache_root: str | os.PathLike = DEFAULT_ROOT, ident: str | None = None,
          force: bool = False) -> tuple[list[str], dict[str, list[str]]]:  # fmt: skip
    """Remove this user's store caches (only the one named ``ident`` when given).

    A cache that live processes still use is left alone unless ``force`` (their open copies
    stay readable: the memory is freed when they unmap it).

    Returns:
        (ids removed, {id: live users} of those left alone).
    """
    base = base_dir(cache_root, create=False)
    removed, busy = [], {}
    for cache in _list(base):
        if not cache.is_dir() or (ident is not None and cache.name != ident):
            continue
        with locked(cache.with_name(cache.name + ".lock")):
            live = prune(cache)
            if live and not force:
                busy[cache.name] = live
                continue
            shutil.rmtree(cache, ignore_errors=True)
            cache.with_name(cache.name + ".lock").unlink(missing_ok=True)
            removed.append(cache.name)
    return removed, busy


def file_size(path: Path) -> int:
    """The size of ``path``, 0 once gone (another process may remove it meanwhile)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
