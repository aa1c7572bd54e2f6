"""Copying a shard's LMDB file and checking the copy: its bytes and its records."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ingest import format as fmt
from ingest.format.checksum import crc32
from ingest.format.pages import open_lmdb

CHUNK = 8 << 20


def copy_bytes(src: Path, fd: int, size: int) -> str:
    """Copy ``size`` bytes of ``src`` into ``fd``; return their SHA-256."""
    sha = hashlib.sha256()
    with open(src, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        done = 0
        while done < size:
            chunk = f.read(min(CHUNK, size - done))
            if not chunk:
                raise OSError(f"{src} shrank while it was copied")
            sha.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
            done += len(chunk)
    return sha.hexdigest()


def records_digest(shard_dir: Path, entry: dict) -> str | None:
    """The content checksum (docs/FORMAT.md) of the records in ``shard_dir``; None when its keys
    are not exactly those the manifest gives the shard."""
    crcs, sizes, keys = [], [], []
    env = open_lmdb(shard_dir, readonly=True, lock=False, readahead=False, max_readers=1)
    try:
        with env.begin(buffers=True) as txn:
            for i, value in fmt.shard_records(txn):
                keys.append(i)
                crcs.append(crc32(value))
                sizes.append(len(value))
    finally:
        env.close()
    if keys != list(range(entry["first"], entry["first"] + entry["count"])):
        return None
    return fmt.records_digest(entry["first"], np.array(crcs), np.array(sizes))


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()
