"""The on-disk contract of a store: layout, keys, index dtype, manifest. See FORMAT.md."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "imfeed-lmdb"
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
INDEX = "index.npy"
PATHS = "paths.msgpack"
REJECTS = "rejects.jsonl"
BUILD_STATE = ".build-state.json"
PARTIAL_DIR = ".partial"

# Per-sample index, one fixed-size little-endian row per sample, in key order.
INDEX_DTYPE = np.dtype(
    [
        ("label", "<i4"),
        ("shard", "<u4"),
        ("nbytes", "<u4"),  # size of the stored LMDB value (the packed record)
        ("height", "<u4"),
        ("width", "<u4"),
        ("crc32", "<u4"),  # zlib.crc32 of the stored LMDB value
        ("format", "u1"),  # FORMAT_CODES
        ("flags", "u1"),  # FLAG_* bits
        ("channels", "u1"),
        ("subsampling", "u1"),  # SUBSAMPLING_CODES, 0 when not a JPEG
    ]
)

# Payload image formats (the "format" field of a record).
FORMAT_CODES = {"jpeg": 1, "png": 2}
FORMAT_NAMES = {v: k for k, v in FORMAT_CODES.items()}

# JPEG chroma subsampling (the "subsampling" field of a record).
SUBSAMPLING_CODES = {
    "gray": 1,
    "4:4:4": 2,
    "4:2:2": 3,
    "4:2:0": 4,
    "4:4:0": 5,
    "4:1:1": 6,
    "other": 7,
}
SUBSAMPLING_NAMES = {v: k for k, v in SUBSAMPLING_CODES.items()}

FLAG_PROGRESSIVE = 1  # progressive JPEG (hardware JPEG decoders take baseline only)
FLAG_REENCODED = 2  # the payload is not the source file's bytes
FLAG_COMPRESSED = 4  # the payload is zstd-compressed inside the record


def shard_name(shard: int) -> str:
    """Directory name of shard number ``shard`` (an LMDB environment)."""
    return f"shard-{shard:05d}"


def encode_key(index: int) -> bytes:
    """LMDB key of global sample ``index``: 8 bytes, big-endian, so keys sort numerically."""
    return index.to_bytes(8, "big")


def decode_key(key: bytes) -> int:
    return int.from_bytes(key, "big")


def records_digest(first: int, crc32: np.ndarray, nbytes: np.ndarray) -> str:
    """A shard's content checksum: SHA-256 over, for each record in key order, its 8-byte
    big-endian key, then the CRC-32 and the length of its value, 4 bytes little-endian each.

    Computed at build time from the index rows (free: workers already CRC each record) and
    at verify time from the records read back, so any changed record changes it.
    """
    rows = np.empty(len(crc32), dtype=[("key", ">u8"), ("crc32", "<u4"), ("nbytes", "<u4")])
    rows["key"] = np.arange(first, first + len(crc32), dtype=np.uint64)
    rows["crc32"], rows["nbytes"] = crc32, nbytes
    return hashlib.sha256(rows.tobytes()).hexdigest()


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


class StoreError(ValueError):
    """A path that is not a complete, readable store of this format."""


def read_manifest(root: str | os.PathLike) -> dict:
    """Read and check the manifest of the store at ``root``.

    Raises:
        StoreError: ``root`` is missing, incomplete (no manifest) or of another format version.
    """
    root = Path(root)
    if not root.is_dir():
        raise StoreError(
            f"{root}: no such store directory; build one with `ingest build SRC {root}`"
        )
    path = root / MANIFEST
    if not path.is_file():
        hint = " (an interrupted build: run the same `ingest build` again to resume)"
        hint = hint if (root / BUILD_STATE).exists() else ""
        raise StoreError(f"{root}: not a complete store, {MANIFEST} is missing{hint}")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_NAME:
        raise StoreError(f"{path}: format is {manifest.get('format')!r}, not {FORMAT_NAME!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise StoreError(
            f"{path}: format version {manifest.get('version')} is not supported by this "
            f"code (version {FORMAT_VERSION}); rebuild the store or upgrade imfeed"
        )
    return manifest


def load_index(root: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """Load the per-sample index (structured array of INDEX_DTYPE); never unpickles."""
    arr = np.load(Path(root) / INDEX, mmap_mode="r" if mmap else None, allow_pickle=False)
    if arr.dtype != INDEX_DTYPE:
        raise StoreError(f"{root}/{INDEX}: dtype {arr.dtype} is not the index dtype of v1")
    return arr
