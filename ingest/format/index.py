"""The per-sample index and the rejects file, each read through ``store_file`` and checked
against the manifest; and the pixel limit a reader holds a store's images to."""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path

import numpy as np

from ingest.format.errors import PixelLimitError, StoreError, edited
from ingest.format.layout import (
    DEFAULT_MAX_PIXELS,
    FORMAT_CODES,
    FORMAT_NAMES,
    INDEX,
    INDEX_DTYPE,
    MAX_MANIFEST_BYTES,
)
from ingest.format.manifest import read_manifest, store_file
from ingest.format.safeio import FileRefused, read_regular, sha256_file


def load_index(root: str | os.PathLike, mmap: bool = True, manifest: dict | None = None):
    """Load the per-sample index (structured array of INDEX_DTYPE), checked against the
    manifest (``index_problem``); never unpickles.

    Raises:
        StoreError: the index is missing, not a valid .npy file or inconsistent.
    """
    manifest = read_manifest(root) if manifest is None else manifest
    path = store_file(root, manifest, "index")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except Exception as e:  # numpy's header parser raises many types (TokenError, ...)
        raise edited(path, f"not a valid index ({type(e).__name__}: {e})") from None
    if arr.dtype != INDEX_DTYPE:
        problem = f"dtype {arr.dtype} is not the index dtype of this format"
    elif arr.ndim != 1:
        problem = f"an array of shape {arr.shape}, where the index is one row a sample"
    else:
        problem = index_problem(arr, manifest)
    if problem:
        raise edited(path, problem)
    if sha256_file(path) != manifest["index"]["sha256"]:  # a label changed to another
        raise edited(path, "checksum mismatch")
    return arr


def index_problem(index: np.ndarray, manifest: dict) -> str | None:
    """What makes ``index`` inconsistent with ``manifest`` (lengths, shard ranges, labels,
    sizes, codes), or None. One pass over the index, vectorised."""
    n, shards = manifest["num_samples"], manifest["shards"]
    if len(index) != n:
        return f"{len(index)} rows, but the manifest counts {n} samples"
    counts = [s["count"] for s in shards]
    firsts = np.cumsum([0, *counts])[:-1].tolist()
    if min(counts, default=0) < 0 or sum(counts) != n or [s["first"] for s in shards] != firsts:
        return "the manifest's shard ranges do not cover the samples in order"
    expected = np.repeat(np.arange(len(shards), dtype=np.uint32), counts)
    labels = index["label"]
    checks = (
        ("shard", np.flatnonzero(index["shard"] != expected)),
        ("label", np.flatnonzero((labels < 0) | (labels >= manifest["num_classes"]))),
        ("nbytes", np.flatnonzero(index["nbytes"] == 0)),
        ("format", np.flatnonzero(~np.isin(index["format"], _codes(manifest)))),
        ("channels", np.flatnonzero(~np.isin(index["channels"], [1, 3]))),
        ("size", np.flatnonzero((index["height"] == 0) | (index["width"] == 0))),
    )  # fmt: skip
    for field, bad in checks:
        if len(bad):
            i = int(bad[0])
            value = _row_text(index[i], field)
            return f"row {i} has an invalid {field} ({value}; {len(bad)} such rows)"
    return None


def _codes(manifest: dict) -> list[int]:
    """The format codes a store of this manifest's version may hold (pixels: from 3 on)."""
    raw = FORMAT_CODES["raw"]
    return [c for c in FORMAT_NAMES if c != raw or manifest.get("version", 0) >= 3]


def pixel_limit(root, manifest: dict, index: np.ndarray, max_pixels: int | None = None) -> int:
    """The most pixels a reader decodes for one image of this store: the store's own limit
    (``options.max_pixels``, set at build time; a version 1 store records none), but never
    more than the reader's ``max_pixels`` (default ``DEFAULT_MAX_PIXELS``), so that a
    store from elsewhere cannot raise it to make one sample cost minutes and gigabytes.

    Raises:
        ValueError: ``max_pixels`` is not a positive integer.
        PixelLimitError: the store allows, and its index holds, an image over the reader's
            limit (said at open, not as samples lost one by one; a store you built with a
            higher ``--max-pixels`` needs a ``max_pixels`` as high when read).
    """
    reader = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    if isinstance(reader, bool) or not isinstance(reader, numbers.Integral) or reader <= 0:
        raise ValueError(f"max_pixels={max_pixels!r}: give a positive number of pixels")
    reader = int(reader)
    own = manifest["options"].get("max_pixels")
    if own is not None and own <= reader:
        return own
    # Rows over the store's own limit are damaged: each is refused as it is read.
    areas = index["height"].astype(np.uint64) * index["width"].astype(np.uint64)  # no wrap
    if own is not None and own < 2**64:
        areas = np.where(areas <= own, areas, 0)
    largest = int(areas.max(initial=0))
    if largest > reader:
        i = int(areas.argmax())
        allows = "records no limit" if own is None else f"allows {own}"
        raise PixelLimitError(
            f"{Path(root) / INDEX}: sample {i} is {_row_text(index[i], 'size')} ({largest} "
            f"pixels), over the reader's limit of {reader} (the store {allows}); if you "
            f"trust the store, raise the limit to {largest} (max_pixels={largest} in "
            f"Python, ingest verify --max-pixels {largest})"
        )
    return reader


def _row_text(row, field: str) -> str:
    if field == "size":
        return f"{row['width']}x{row['height']}"
    return f"{row[field]}"


def read_rejects(root: str | os.PathLike, manifest: dict) -> list[dict]:
    """The rejected files of a store (``rejects.jsonl``), read through ``store_file``.

    Raises:
        StoreError: the file is unsafe to read or not JSON lines.
    """
    path = store_file(root, manifest, "rejects")
    try:
        text = read_regular(path, MAX_MANIFEST_BYTES << 4).decode("utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (FileRefused, ValueError, RecursionError) as e:
        raise StoreError(f"{path}: unreadable ({e}); rebuild the store") from None
    if not all(isinstance(r, dict) for r in rows):
        raise StoreError(f"{path}: a line is not a JSON object; rebuild the store")
    return rows
