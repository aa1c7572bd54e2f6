"""Writes a crash never leaves half done: JSON through a temporary file, fsync and rename;
fsync of a file, or of a folder after a rename into it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename: all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path, *, data_only: bool = False) -> None:
    """fsync (or fdatasync) a file or a directory (after a rename into it) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)
