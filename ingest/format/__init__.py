"""The on-disk contract of a store: layout, keys, index dtype, manifest. See FORMAT.md."""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
import shlex
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ingest.format.lock import holder
from ingest.format.safeio import FileRefused, kind_of, read_regular, sha256_file

FORMAT_NAME = "imfeed-lmdb"
FORMAT_VERSION = 2
# Raised whenever ``ingest.images.normalize.convert`` would store other bytes for the same file
# (2: images cut at their end, PNGs kept only as the readers' check passes them; 3: PNGs
# stored with their critical chunks only, EXIF orientation taken as PIL takes it, JPEGs
# of many scans and lossless ones re-encoded, 12-bit ones and those of over 1,000 scans
# refused, reject reasons without addresses). It enters each build's fingerprint, so that a build
# interrupted under one version starts over under another rather than meet records its
# plans do not describe.
CONVERTER_VERSION = 3
READABLE_VERSIONS = (1, 2)  # v1: no build identity, no file sizes (those checks are skipped)

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
        if not _may(folder, os.X_OK):
            return AccessDenied(f"{folder}: permission denied: {user} may not enter this "
                                "folder; give it access (chmod/chown)")  # fmt: skip
    return AccessDenied(f"{path}: permission denied: {user} may not read it; give it read "
                        "access (chmod/chown)")  # fmt: skip


def _may(path: str | os.PathLike, mode: int) -> bool:
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


class PixelLimitError(StoreError):
    """A store holding an image over the reader's pixel limit (``pixel_limit``)."""


class RecordError(ValueError):
    """One record of a store is damaged (a bad sample, not a bad store)."""


def path_value(rel: str) -> str | bytes:
    """A source path as a store keeps it: the str when it is valid Unicode, else the file
    name's bytes (a name that is not UTF-8 arrives from os.walk with surrogate escapes)."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(rel)
    return rel


def path_text(value: str | bytes) -> str:
    """A stored path as ``os.walk`` gives it (undecodable bytes as surrogate escapes)."""
    return value if isinstance(value, str) else os.fsdecode(value)


def shown(rel: str | bytes) -> str:
    """A path for messages: undecodable bytes and control characters (a terminal's escape
    sequences, line breaks: a store is untrusted) shown as ``\\xNN``."""
    text = os.fsencode(path_text(rel)).decode("utf-8", "backslashreplace")
    return text.translate(_CONTROLS)


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def json_line(obj: dict) -> str:
    """One JSON line, readable UTF-8 where possible; lone surrogates (paths that are not
    UTF-8) escaped as ``\\udcNN``, which json.loads turns back into the same str."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8").decode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj)


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


def _build_command(folder: Path) -> str:
    """The command that converts ``folder`` into a store beside it (outside it, which the
    build requires), as a shell takes it; relative where ``folder`` was given so."""
    real = folder.resolve()
    out = real.parent / f"{real.name or 'images'}.lmdb"
    shown = out if folder.is_absolute() else os.path.relpath(out)
    return f"ingest build {shlex.quote(str(folder))} {shlex.quote(str(shown))}"


def _failed_build(root: Path) -> bool:
    """Whether ``root`` holds the state of a build that found no valid image."""
    try:
        state = json.loads(read_regular(root / BUILD_STATE, 1 << 20))
    except (OSError, ValueError, FileRefused):  # none, or not ours to judge: not failed
        return False
    return isinstance(state, dict) and state.get("failed") is True


def read_manifest(root: str | os.PathLike) -> dict:
    """Read and check the manifest of the store at ``root``.

    Raises:
        StoreError: ``root`` is missing, incomplete (no manifest), of another format
            version, or its manifest is not valid JSON of the expected shape.
    """
    root = Path(root)
    try:
        os.stat(root)
    except PermissionError:  # a folder above it this user may not enter
        raise access_denied(root) from None
    except OSError:
        pass
    if os.path.exists(root) and not root.is_dir():
        raise StoreError(
            f"{root}: not a directory, where a store is the directory `ingest build SRC OUT` writes"
        )
    if not root.is_dir():
        raise StoreError(
            f"{root}: no such store directory; build one with `ingest build SRC {root}`"
        )
    path = root / MANIFEST
    if not _may(root, os.X_OK) or (os.path.lexists(path) and not _may(path, os.R_OK)):
        raise access_denied(path)
    if not os.path.lexists(path):
        from ingest.build.scan import looks_like_image_folder

        if who := holder(root):
            hint = f" (`ingest build` is writing it now, {who}: wait for it to end)"
        elif _failed_build(root):
            hint = (f" (its last build found no valid image: the reasons are in "
                    f"{root / REJECTS}; mend the source and build again)")  # fmt: skip
        elif os.path.exists(root / STAGING_DIR / MANIFEST):
            hint = (" (an --overwrite build was cut short as its new store replaced the old "
                    "one: run the same `ingest build --overwrite` again to finish it)")  # fmt: skip
        elif (root / BUILD_STATE).exists():
            hint = " (an interrupted build: run the same `ingest build` again to resume)"
        elif looks_like_image_folder(root):  # the likeliest slip when swapping in a store
            hint = (f" (it is an image folder: convert it once with `{_build_command(root)}` "
                    "and give that store instead)")  # fmt: skip
        else:
            hint = ""
        raise StoreError(f"{root}: not a complete store, {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(read_regular(path, MAX_MANIFEST_BYTES))
    except FileRefused as e:
        raise StoreError(f"{path}: {e}; rebuild the store") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise StoreError(f"{path}: not valid JSON ({e}); rebuild the store") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise StoreError(f"{path}: format is {found!r}, not {FORMAT_NAME!r}")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise StoreError(
            f"{path}: format version {manifest.get('version')} is not supported by this "
            f"code (version {FORMAT_VERSION}); rebuild the store or upgrade imfeed"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise _edited(path, problem)
    return manifest


def _edited(path: Path, problem: str) -> StoreError:
    """The error for a store file that reads but holds what no build writes."""
    return StoreError(f"{path}: {problem}; the store is damaged or was edited: rebuild it")


_SHARD_KEYS = {"name": str, "first": int, "count": int, "record_bytes": int,
               "file_bytes": int, "digest": str}  # fmt: skip


def _is_count(value: int) -> bool:
    """An integer a count or a size may be: JSON's have no bound (10**400 would overflow
    every float made of it), nor a sign."""
    return not isinstance(value, bool) and 0 <= value < 1 << 63


def _is_hex(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128 and not value.strip("0123456789abcdef")


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with the shape of a manifest (keys, types, shard names), or None."""
    for key, typ in (("num_samples", int), ("num_classes", int), ("classes", list),
                     ("shards", list), ("index", dict), ("paths", dict), ("rejects", dict),
                     ("options", dict), ("num_seen", int), ("num_rejected", int),
                     ("num_ignored", int), ("ignored_by_reason", dict), ("stats", dict),
                     ("record_bytes", int)):  # fmt: skip
        if not isinstance(m.get(key), typ):
            return f"{key!r} is missing or not a {typ.__name__}"
        if typ is int and not _is_count(m[key]):
            return f"{key!r} is not a count (an integer from 0 to 2**63 - 1)"
    for key in ("stats", "ignored_by_reason"):
        if not all(isinstance(n, int) and _is_count(n) for n in m[key].values()):
            return f"{key!r} holds a value that is not a count"
    if m["num_samples"] == 0:
        return "'num_samples' is 0, where a build writes a store of at least one sample"
    if m["version"] >= 2 and not _is_hex(m.get("build")):
        return "'build' is missing or not a hexadecimal string"
    limit = m["options"].get("max_pixels", 1)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return "'options.max_pixels' is not a positive integer"
    if len(m["classes"]) != m["num_classes"] or not all(isinstance(c, str) for c in m["classes"]):
        return f"'classes' does not list {m['num_classes']} class names"
    for k, entry in enumerate(m["shards"]):
        if not isinstance(entry, dict):
            return f"shard {k} is not a JSON object"
        bad = [key for key, typ in _SHARD_KEYS.items() if not isinstance(entry.get(key), typ)
               or (typ is int and not _is_count(entry[key]))]  # fmt: skip
        if bad:
            return f"shard {k} lacks a valid {bad[0]!r}"
        if entry["name"] != shard_name(k):
            return f"shard {k} is named {entry['name']!r}, where the format says {shard_name(k)!r}"
    for key, name in (("index", INDEX), ("paths", PATHS), ("rejects", REJECTS)):
        if m[key].get("file") != name or not isinstance(m[key].get("sha256"), str):
            return f"{key!r} must name the file {name!r} with its sha256"
    return None


def store_file(root: str | os.PathLike, manifest: dict, what: str | int) -> Path:
    """The path of one file of a store, checked before anyone opens or maps it.

    The one resolver every reader and ``ingest verify`` use: the file must be the one the
    format names, lie inside the store once links are resolved, be a regular file (not a
    FIFO or a device, which would hang a reader) and have the size the manifest records
    (a truncated ``data.mdb`` would kill a reader with SIGBUS when mapped).

    Args:
        what: "index", "paths" or "rejects", or a shard number (its ``data.mdb``).

    Raises:
        StoreError: naming the file and what is wrong with it.
    """
    root = Path(root)
    if isinstance(what, str):
        rel, size = manifest[what]["file"], manifest[what].get("bytes")
    else:
        entry = manifest["shards"][what]
        rel, size = f"{entry['name']}/data.mdb", entry["file_bytes"]
    path = root / rel
    real, inside = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, inside]) != inside:
        raise StoreError(f"{path}: leads outside the store (to {real}); rebuild the store")
    try:
        st = os.stat(real)
    except PermissionError:  # a folder on the way this user may not enter
        raise access_denied(path) from None
    except OSError as e:
        raise StoreError(
            f"{path}: {e.strerror or e}; the store is incomplete: rebuild it"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{path}: {kind_of(st.st_mode)}, not a regular file; rebuild the store")
    if size is not None and st.st_size != size:
        raise StoreError(
            f"{path}: {st.st_size} bytes where the manifest records {size} (truncated or "
            "replaced); the store is damaged: rebuild it"
        )
    if not _may(real, os.R_OK):
        raise access_denied(path)
    return path


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
        raise _edited(path, f"not a valid index ({type(e).__name__}: {e})") from None
    if arr.dtype != INDEX_DTYPE:
        problem = f"dtype {arr.dtype} is not the index dtype of this format"
    elif arr.ndim != 1:
        problem = f"an array of shape {arr.shape}, where the index is one row a sample"
    else:
        problem = index_problem(arr, manifest)
    if problem:
        raise _edited(path, problem)
    if sha256_file(path) != manifest["index"]["sha256"]:  # a label changed to another
        raise _edited(path, "checksum mismatch")
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
        ("format", np.flatnonzero(~np.isin(index["format"], list(FORMAT_NAMES)))),
        ("channels", np.flatnonzero(~np.isin(index["channels"], [1, 3]))),
        ("size", np.flatnonzero((index["height"] == 0) | (index["width"] == 0))),
    )  # fmt: skip
    for field, bad in checks:
        if len(bad):
            i = int(bad[0])
            value = _row_text(index[i], field)
            return f"row {i} has an invalid {field} ({value}; {len(bad)} such rows)"
    return None


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


def check_record(record: object) -> str | None:
    """What makes an unpacked record unusable (not a map, a field of the wrong type), or
    None. Readers check this before using a record: a store is untrusted input."""
    if not isinstance(record, dict):
        return f"not a map but {type(record).__name__}"
    for key, types in _RECORD_TYPES.items():
        if not isinstance(record.get(key), types):
            return f"field {key!r} is {type(record.get(key)).__name__}, not {types[0].__name__}"
    if record["format"] not in FORMAT_CODES:
        return f"unknown image format {record['format']!r}"
    if not isinstance(record.get("path", ""), (str, bytes)):
        return f"field 'path' is {type(record['path']).__name__}, not str"
    return None


_RECORD_TYPES = {"image": (bytes,), "label": (int,), "format": (str,), "height": (int,),
                 "width": (int,), "compression": (str, type(None))}  # fmt: skip
