"""Read a file that may be hostile: regular files only, bounded size, never blocking.

Every file this project reads from an untrusted place (a source image, a store's
manifest, paths or rejects file) is read through ``read_regular``: a FIFO, socket or
device named like an image (or a link to one, e.g. to ``/dev/zero``) is refused instead
of blocking in ``open()`` or filling memory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

_ONE_READ = 0x7FFFF000  # the most Linux's read() returns at once


class FileRefused(ValueError):
    """The file cannot be read safely; ``str(self)`` says why, without the path."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_regular(path: str | os.PathLike, max_bytes: int, *, size: int | None = None) -> bytes:
    """The bytes of ``path`` (links followed), if it is a regular file of at most ``max_bytes``.

    Args:
        max_bytes: refuse a larger file (checked before reading; a file that changes size
            while it is read is refused too).
        size: when given, the file must have exactly this size.

    Raises:
        FileRefused: not a regular file, too large, of another size, or unreadable (the
            reason names the cause: a broken link, a link loop, a vanished file...).
    """
    fd, st = _open_regular(path)
    try:
        _check_size(st.st_size, max_bytes, size)
        data = _read(fd, st.st_size + 1)  # one more byte tells a file that grows
    except OSError as e:
        raise FileRefused(f"unreadable: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise FileRefused(f"changed while being read ({st.st_size} bytes, then {len(data)})")
    return data


def _read(fd: int, most: int) -> bytes:
    """Up to ``most`` bytes of ``fd``, to its end: in one ``os.read`` (no buffered file
    object: every source image is read this way, twice per build), or, past what Linux
    reads at once, into one buffer (parts joined would take twice the memory)."""
    if most > _ONE_READ:
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(most)
    parts = []
    while most > 0 and (part := os.read(fd, most)):
        parts.append(part)
        most -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def open_regular(path: str | os.PathLike) -> int:
    """An O_RDONLY descriptor of ``path`` if, links followed, it is a regular file.

    O_NONBLOCK keeps ``open()`` of a FIFO from waiting for a writer; it is cleared again
    (it means nothing for a regular file, but readers should not see it).

    Raises:
        FileRefused: not a regular file, or it cannot be opened (with the cause).
    """
    return _open_regular(path)[0]


def _open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """``open_regular``'s descriptor and what fstat() said of it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileRefused(open_failure(path, e)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileRefused(f"not a regular file: {kind_of(st.st_mode)}")
    os.set_blocking(fd, True)
    return fd, st


def open_failure(path: str | os.PathLike, e: OSError) -> str:
    """Why ``path`` could not be opened, in words a user acts on."""
    if e.errno == errno.ELOOP:
        return "unreadable: a symbolic link loop"
    if e.errno == errno.ENOENT:
        if os.path.islink(path):
            return "unreadable: a broken symbolic link (its target does not exist)"
        return "unreadable: the file vanished during the build"
    if e.errno == errno.ENXIO:  # a socket (open() cannot open one)
        try:
            return f"not a regular file: {kind_of(os.stat(path).st_mode)}"
        except OSError:
            return "not a regular file"
    return f"unreadable: {e.strerror or e}"


def _check_size(actual: int, max_bytes: int, size: int | None) -> None:
    if actual > max_bytes:
        raise FileRefused(f"too large: {actual} bytes, over the limit of {max_bytes} bytes")
    if size is not None and actual != size:
        raise FileRefused(f"{actual} bytes where {size} were recorded (truncated or replaced)")


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """The hex SHA-256 of the regular file ``path`` (never a FIFO or a device)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
