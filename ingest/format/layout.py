"""The names of a store's files and shards, their keys and index row, and which entries of
OUT a build may delete: the fixed part of the on-disk contract (docs/FORMAT.md)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np

FORMAT_NAME = "imfeed-lmdb"
FORMAT_VERSION = 3  # the newest this code writes (``written_version``)
# Raised whenever ``ingest.images.normalize.convert`` would store other bytes for the same file
# (2: images cut at their end, PNGs kept only as the readers' check passes them; 3: PNGs
# stored with their critical chunks only, EXIF orientation taken as PIL takes it, JPEGs
# of many scans and lossless ones re-encoded, 12-bit ones and those of over 1,000 scans
# refused, reject reasons without addresses). It enters each build's fingerprint, so that a build
# interrupted under one version starts over under another rather than meet records its
# plans do not describe.
CONVERTER_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # v1: no build identity, no file sizes (those checks are skipped)


def written_version(encoding: str) -> int:
    """The format version of a build with ``--encoding encoding``: 3 where it may store
    pixel records, else 2 (a store of JPEGs and PNGs that readers of version 2 still read,
    byte for byte what they wrote)."""
    return 2 if encoding == "jpeg" else 3


MANIFEST = "manifest.json"
INDEX = "index.npy"
PATHS = "paths.msgpack"
REJECTS = "rejects.jsonl"
BUILD_STATE = ".build-state.json"
PARTIAL_DIR = ".partial"
STAGING_DIR = ".overwrite"  # an --overwrite build's new store, until it replaces the old one
RETIRED_DIR = ".replaced"  # the old store's files, set aside while the new one moves in

# Per-sample index, one fixed-size little-endian row per sample, in key order.
INDEX_DTYPE = np.dtype(
    [
        ("label", "<i4"),
        ("shard", "<u4"),
        ("nbytes", "<u4"),  # size of the stored LMDB value (the packed record)
        ("height", "<u4"),
        ("width", "<u4"),
        ("crc32", "<u4"),  # CRC-32 (zlib's) of the stored LMDB value
        ("format", "u1"),  # FORMAT_CODES
        ("flags", "u1"),  # FLAG_* bits
        ("channels", "u1"),
        ("subsampling", "u1"),  # SUBSAMPLING_CODES, 0 when not a JPEG
    ]
)

# Payload image formats (the "format" field of a record).
FORMAT_CODES = {"jpeg": 1, "png": 2, "raw": 3}  # raw: uint8 pixels, HxWxC
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
FLAG_REENCODED = 2  # the payload is not the source file's bytes, nor their beginning
FLAG_COMPRESSED = 4  # the payload is zstd-compressed inside the record

# The one key of a shard that is not a record (records have 8-byte keys): the identity of
# the build that wrote the shard, the manifest's "build" (ASCII hex).
BUILD_KEY = b"imfeed:build"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of a million shards is smaller
# Images over this many pixels are refused (``ingest build --max-pixels``; readers of a
# version 1 store, which records no limit): PIL's own refusal threshold, twice its
# MAX_IMAGE_PIXELS, 13,377 x 13,377. Nearly every photograph is far below it.
DEFAULT_MAX_PIXELS = 2 * 89_478_485
# The source files a build takes as images: torchvision's IMG_EXTENSIONS plus GIF and
# JFIF, matched case-insensitively, as it does (docs/FORMAT.md: ImageFolder lists the source).
IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif", ".jfif",
)  # fmt: skip


def shard_name(shard: int) -> str:
    """Directory name of shard number ``shard`` (an LMDB environment)."""
    return f"shard-{shard:05d}"


_SHARD_NAME = re.compile(r"shard-\d{5,}")
_BUILD_FILES = {MANIFEST, INDEX, PATHS, REJECTS, BUILD_STATE, PARTIAL_DIR,
                f"{MANIFEST}.tmp", f"{BUILD_STATE}.tmp"}  # fmt: skip


def own_entries(directory: str | os.PathLike) -> list[str]:
    """The entries of ``directory`` that a build writes (a store's files and shards, a
    build's state and leftovers), the only ones a build may delete; never the build lock,
    an --overwrite build's folders, or anything else a user keeps there."""
    return sorted(n for n in os.listdir(directory)
                  if n in _BUILD_FILES or _SHARD_NAME.fullmatch(n))  # fmt: skip


def remove_entry(path: Path) -> None:
    """Delete one entry that ``own_entries`` named: a folder with what it holds, a file, or
    a symlink itself (never what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def encode_key(index: int) -> bytes:
    """LMDB key of global sample ``index``: 8 bytes, big-endian, so keys sort numerically."""
    return index.to_bytes(8, "big")


def decode_key(key: bytes) -> int:
    return int.from_bytes(key, "big")


def shard_records(txn):
    """Yield (sample index, value) of every record in an LMDB read transaction of a shard,
    in key order, passing over the keys that are not records (the build identity)."""
    for key, value in txn.cursor():
        if len(key) == 8:
            yield decode_key(bytes(key)), value


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
