"""Reading a store's values checked: one record (its length, CRC-32, fields and label
against the index) and the list of source paths. A store is untrusted input: every
message names the shard and key, or the file, and says what to do."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lmdb
import msgpack
import numpy as np

from ingest import format as fmt
from ingest.format.checksum import crc32
from ingest.format.codec import row_problem, unpack_record
from ingest.format.safeio import FileRefused, read_regular


def read_value(env: lmdb.Environment, where: str, i: int, nbytes: int | None, advice: str) -> bytes:
    """``Store.raw``'s read of key ``i`` in ``env``, the shard ``where``."""
    with env.begin(buffers=True) as txn:
        return bytes(_mapped_value(txn, where, i, nbytes, advice))


def _mapped_value(txn, where: str, i: int, nbytes: int | None, advice: str) -> memoryview:
    """Key ``i``'s value where LMDB maps it (valid in ``txn``), of ``nbytes`` bytes."""
    view = txn.get(fmt.encode_key(i))
    if view is None:
        raise KeyError(f"{where}: key {i} is missing")
    if nbytes is not None and len(view) != nbytes:
        raise fmt.RecordError(
            f"{where}: key {i}: the record is {len(view)} bytes, the index says {nbytes}" + advice
        )
    return view


def read_record(env: lmdb.Environment, where: str, i: int, row: np.void, advice: str) -> dict:
    """``Store.record``'s read and checks of key ``i`` (index row ``row``) in ``env``. The
    value is summed and parsed where LMDB maps it: a copy of it first would double the
    memory traffic of a pixel store's reads."""
    at = f"{where}: key {i}"
    with env.begin(buffers=True) as txn:
        value = _mapped_value(txn, where, i, int(row["nbytes"]), advice)
        if crc32(value) != row["crc32"]:
            raise fmt.RecordError(
                f"{at}: the record's bytes differ from the index (CRC-32 mismatch){advice}"
            )
        try:
            rec = unpack_record(value)  # its fields copied out of the mapped pages
        except Exception as e:  # msgpack raises several types
            raise fmt.RecordError(f"{at}: does not unpack: {e}") from None
        finally:
            del value  # (a traceback must not keep a view of the pages)
    problem = fmt.check_record(rec)
    if problem:
        raise fmt.RecordError(f"{at}: malformed record: {problem}")
    if rec["label"] != row["label"]:
        raise fmt.RecordError(
            f"{at}: label {rec['label']} differs from the index's ({row['label']}){advice}"
        )
    problem = row_problem(rec, row)
    if problem:
        raise fmt.RecordError(f"{at}: {problem}{advice}")
    return rec


def verify_advice(reason: str, root: Path) -> str:
    """What a message about a record ``reason`` ends with: ``ingest verify``'s advice,
    unless ``reason`` (one of the store's errors) gives it already."""
    return "" if "`ingest verify " in reason else f"; check the store with `ingest verify {root}`"


def read_paths(root: Path, manifest: dict) -> list[str]:
    """The store's list of source paths, checked against the manifest."""
    path = fmt.store_file(root, manifest, "paths")
    try:
        data = read_regular(path, 1 << 40, size=manifest["paths"].get("bytes"))
        paths = msgpack.unpackb(data, raw=False)
    except (FileRefused, ValueError, msgpack.UnpackException) as e:
        raise fmt.StoreError(f"{path}: unreadable ({e}); rebuild the store") from None
    if not isinstance(paths, list) or len(paths) != manifest["num_samples"]:
        raise fmt.StoreError(f"{path}: does not list {manifest['num_samples']} paths")
    if not all(isinstance(p, (str, bytes)) for p in paths):
        raise fmt.StoreError(f"{path}: an entry is not a path; rebuild the store")
    if hashlib.sha256(data).hexdigest() != manifest["paths"]["sha256"]:
        raise fmt.StoreError(f"{path}: checksum mismatch; rebuild the store")
    return [fmt.path_text(p) for p in paths]
