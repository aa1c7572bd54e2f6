"""The manifest, read last and trusted first: its shape checked before any reader uses it,
and ``store_file``, the one resolver of a store's files that every reader goes through."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ingest.format.errors import StoreError, access_denied, edited, permitted
from ingest.format.hints import missing_manifest_hint
from ingest.format.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    PATHS,
    READABLE_VERSIONS,
    REJECTS,
    shard_name,
)
from ingest.format.safeio import FileRefused, kind_of, read_regular


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
    if not permitted(root, os.X_OK) or (os.path.lexists(path) and not permitted(path, os.R_OK)):
        raise access_denied(path)
    if not os.path.lexists(path):
        hint = missing_manifest_hint(root)
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
        raise edited(path, problem)
    return manifest


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
    if not permitted(real, os.R_OK):
        raise access_denied(path)
    return path
