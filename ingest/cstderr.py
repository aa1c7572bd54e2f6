"""Capture what C libraries write to the process's stderr (fd 2) around a call.

libjpeg (inside OpenCV), libtiff and others print warnings straight to fd 2, through any
progress bar and once per epoch in training, where Python cannot catch them. Decoding
code runs inside ``captured()``: fd 2 points at a per-process scratch file for the call,
and what was written comes back as text, for the caller to turn into an outcome (a
reject, a replaced sample) instead of noise on the user's terminal.

Another thread of the same process that writes to stderr during the call is captured
too: ``captured`` is for worker processes, where nothing else writes to stderr;
``filtered`` keeps only a library's own lines and writes the rest back. Calls that
overlap in one process (two decode threads) share one redirection: the first in points
fd 2 at the scratch file, the last out points it back and takes everything written
meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

_SCRATCH: dict[int, int] = {}  # pid -> descriptor of that process's scratch file
_MAX_TEXT = 4096  # keep the first bytes of a flood of warnings
_LOCK = threading.Lock()
_STATE = {"inside": 0, "saved": -1}  # calls inside a redirection, the saved fd 2


def _before_fork() -> None:
    _LOCK.acquire()  # fork with the state settled, never mid-change


def _after_fork_in_parent() -> None:
    _LOCK.release()


def _after_fork_in_child() -> None:
    """A child forked while a call was inside a redirection gets the real stderr back (it
    would write into the parent's scratch file for good), and a lock of its own."""
    global _LOCK
    _LOCK = threading.Lock()
    if _STATE["inside"]:
        os.dup2(_STATE["saved"], 2)
        os.close(_STATE["saved"])
    _STATE.update(inside=0, saved=-1)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)


def _scratch() -> int:
    fd = _SCRATCH.get(os.getpid())
    if fd is None:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("imfeed-stderr", os.MFD_CLOEXEC)
        else:
            fd, name = tempfile.mkstemp(prefix="imfeed-stderr-")
            os.unlink(name)
        _SCRATCH[os.getpid()] = fd
    return fd


@contextlib.contextmanager
def _redirected(limit: int | None) -> Iterator[list[bytes]]:
    """Run the body with fd 2 pointing at this process's scratch file; the yielded list
    then holds what was written (at most ``limit`` bytes; all when None)."""
    out: list[bytes] = []
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with _LOCK:
        scratch = _scratch()
        if not _STATE["inside"]:
            _STATE["saved"] = os.dup(2)
            os.dup2(scratch, 2)
        _STATE["inside"] += 1
    try:
        yield out
    finally:
        with _LOCK:
            _STATE["inside"] -= 1
            if not _STATE["inside"]:  # the last call out restores fd 2 and takes the text
                os.dup2(_STATE["saved"], 2)
                os.close(_STATE["saved"])
                size = os.lseek(scratch, 0, os.SEEK_CUR)
                if size:
                    out.append(os.pread(scratch, size if limit is None else min(size, limit), 0))
                    os.ftruncate(scratch, 0)
                    os.lseek(scratch, 0, os.SEEK_SET)


@contextlib.contextmanager
def still() -> Iterator[set[int]]:
    """No redirection begins or ends in the body; yields the descriptors that one in flight
    holds meanwhile (the saved stderr, or none), for an exact count of the process's."""
    with _LOCK:
        yield {_STATE["saved"]} if _STATE["inside"] else set()


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Run the body with fd 2 redirected; the yielded list then holds what was written
    (one string, stripped; empty list when nothing was)."""
    out: list[str] = []
    with _redirected(_MAX_TEXT) as raw:
        yield out
    text = b"".join(raw).decode("utf-8", "replace")
    if text.strip():
        out.append(" ".join(text.split()))


@contextlib.contextmanager
def filtered(noise: re.Pattern[str]) -> Iterator[list[str]]:
    """Like ``captured``, for a library called in a process whose other threads may write
    to stderr too (the training process): the lines that match ``noise`` are kept in the
    yielded list, every other line is written back to stderr afterwards, late but intact."""
    out: list[str] = []
    with _redirected(None) as raw:
        yield out
    keep = []
    for line in b"".join(raw).decode("utf-8", "replace").splitlines(keepends=True):
        (out if noise.search(line) else keep).append(line)
    if keep:
        os.write(2, "".join(keep).encode())
    out[:] = [" ".join(line.split()) for line in out]
