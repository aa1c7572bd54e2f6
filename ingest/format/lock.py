"""The lock by which one `ingest build` owns OUT: held while it runs, gone with its process.

An flock on OUT/.build.lock (kept, never unlinked: unlinking a lock file lets a second
build lock a new file while a third still holds the old one). The holder writes its host
and pid in it, so that a second build, `ingest info` and `ingest verify` can say who is
writing OUT instead of calling it an interrupted build.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK = ".build.lock"


class Busy(Exception):
    """Another process holds OUT's build lock; the message says who."""


class BuildLock:
    """OUT's build lock, held by this process from ``__enter__`` to ``__exit__``.

    Raises:
        Busy: another build holds it (checked at once, never waited for).
    """

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK
        self.fd: int | None = None

    def __enter__(self) -> BuildLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _lock(fd)
            os.ftruncate(fd, 0)
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise Busy(who) from None
        except BaseException:  # a full disk while writing the pid: the lock not kept
            os.close(fd)
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


def holder(root: str | os.PathLike) -> str | None:
    """Who holds the build lock of ``root`` ("pid N on HOST"), or None when no build runs
    there (no lock file, an unreadable one, or nobody holding it)."""
    try:
        fd = os.open(Path(root) / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # also releases the shared lock, if taken
    return None


def _lock(fd: int, tries: int = 20) -> None:
    """The exclusive lock, or BlockingIOError once another build holds it: a reader's
    ``holder`` takes it shared for an instant, which must not fail a build starting then."""
    for _ in range(tries - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.01)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _holder(fd: int) -> str:
    try:
        host, pid = os.pread(fd, 300, 0).decode("ascii", "replace").split()
    except (OSError, ValueError):  # written by nothing of ours, or not yet
        return "another process"
    return f"pid {pid}" if host == socket.gethostname() else f"pid {pid} on {host}"
