"""The errors of reading a store: a bad store, one this user may not read, one over the
reader's pixel limit, and one bad record (a bad sample, not a bad store)."""

from __future__ import annotations

import os
from pathlib import Path


class StoreError(ValueError):
    """A path that is not a complete, readable store of this format."""


class AccessDenied(StoreError):
    """A file or folder of a store that this user may not read: its permissions are wrong,
    not the store (no rebuild helps)."""


def access_denied(path: str | os.PathLike) -> AccessDenied:
    """The error for ``path``, which this user may not read, or for the first folder above
    it that it may not enter."""
    user = f"this user (uid {os.geteuid()})"
    for folder in reversed(Path(os.path.abspath(path)).parents):
        if not permitted(folder, os.X_OK):
            return AccessDenied(f"{folder}: permission denied: {user} may not enter this "
                                "folder; give it access (chmod/chown)")  # fmt: skip
    return AccessDenied(f"{path}: permission denied: {user} may not read it; give it read "
                        "access (chmod/chown)")  # fmt: skip


def permitted(path: str | os.PathLike, mode: int) -> bool:
    """Whether this user may access ``path`` so (by its effective ids where it can)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


class PixelLimitError(StoreError):
    """A store holding an image over the reader's pixel limit (``pixel_limit``)."""


class RecordError(ValueError):
    """One record of a store is damaged (a bad sample, not a bad store)."""


def edited(path: Path, problem: str) -> StoreError:
    """The error for a store file that reads but holds what no build writes."""
    return StoreError(f"{path}: {problem}; the store is damaged or was edited: rebuild it")
