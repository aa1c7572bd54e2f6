"""Failures to write OUT (no permission, a full disk, an I/O error) as one-line
OutputErrors that say what to do; any other error keeps its traceback."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import lmdb

from ingest import format as fmt
from ingest.build.resume import OutputError
from ingest.build.writer import MiB

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """Failures to write OUT as one-line OutputErrors (``write_failure``); others as they
    are, with their tracebacks."""
    try:
        yield
    except (lmdb.Error, OSError) as e:
        failure = write_failure(out, e)
        if failure is None:
            raise
        raise failure from e


def write_failure(out: Path, e: Exception) -> OutputError | None:
    """A one-line OutputError for a failure to write OUT (a full disk, an I/O error), or
    None for an error that is not about writing (it keeps its traceback)."""
    if isinstance(e, OSError) and e.errno not in (*_FULL, *_DENIED, errno.EIO, errno.EROFS):
        return None
    if getattr(e, "errno", None) in _DENIED:
        return OutputError(
            f"output {out}: this user may not write there ({e.strerror}: "
            f"{fmt.shown(str(e.filename or out))}); give it write access, or choose another folder"
        )
    try:
        st = os.statvfs(out)
        full = st.f_bavail * st.f_frsize < 64 * MiB
    except OSError:
        full = False
    if full or getattr(e, "errno", None) in _FULL:
        return OutputError(
            f"output {out}: its filesystem is full ({e}); free some space and run the same "
            "command again: it resumes from the last completed shard"
        )
    return OutputError(
        f"output {out}: writing failed ({e}); check the disk, then run the same command "
        "again: it resumes from the last completed shard"
    )
