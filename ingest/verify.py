"""verify_store(): check every shard against its build-time checksums and decode every record."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import cv2
import lmdb
import numpy as np
from tqdm import tqdm

from ingest import format as fmt
from ingest.codec import image_bytes, unpack_record
from ingest.writer import sha256_file


def verify_store(
    root: str | os.PathLike, *, decode: bool = True, progress: bool | None = None
) -> list[str]:
    """Return every problem found in the store at ``root`` (empty: the store is sound).

    Checks the SHA-256 of the index, paths and rejects files; then reads every record of
    every shard, checking its key, its CRC-32 and length (recorded in the index), its
    fields and, with ``decode``, that its image decodes to the recorded size; and each
    shard's content checksum (``ingest.format.records_digest``) against the manifest.
    Problems name the shard, and the key where one record is at fault. ``progress`` shows
    a progress bar, as ``ingest build`` does (default: when stderr is a terminal).

    Raises:
        ingest.format.StoreError: ``root`` is not a complete store.
    """
    root = Path(root)
    manifest = fmt.read_manifest(root)
    problems = [
        f"{entry['file']}: checksum mismatch"
        for entry in (manifest["index"], manifest["paths"], manifest["rejects"])
        if sha256_file(root / entry["file"]) != entry["sha256"]
    ]
    if problems and problems[0].startswith(fmt.INDEX):
        return problems  # without a sound index the records cannot be checked
    index = fmt.load_index(root, mmap=False)
    if len(index) != manifest["num_samples"]:
        return [*problems, f"{fmt.INDEX}: {len(index)} rows for {manifest['num_samples']} samples"]
    bar = tqdm(
        total=len(index), unit="img", desc="verify", smoothing=0.05,
        disable=None if progress is None else not progress,
    )  # fmt: skip
    with bar:
        for shard, entry in enumerate(manifest["shards"]):
            problems.extend(_check_shard(root, shard, entry, index, decode, bar.update))
    return problems


def _check_shard(
    root: Path, shard: int, entry: dict, index: np.ndarray, decode: bool, tick=None
) -> list:
    name = entry["name"]
    if not (root / name / "data.mdb").is_file():
        return [f"{name}: data.mdb is missing"]
    crcs: list[int] = []
    sizes: list[int] = []
    try:
        records = _check_records(root / name, name, entry, index, decode, crcs, sizes, tick)
        problems = list(records)
    except lmdb.Error as e:
        return [f"{name}: LMDB cannot read the shard: {e}"]
    if fmt.records_digest(entry["first"], np.array(crcs), np.array(sizes)) != entry["digest"]:
        problems.append(f"{name}: content checksum mismatch (records changed since the build)")
    return problems


def _check_records(
    path: Path,
    name: str,
    entry: dict,
    index: np.ndarray,
    decode: bool,
    crcs: list,
    sizes: list,
    tick=None,
) -> Iterator[str]:
    env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
    try:
        with env.begin() as txn:
            expected = entry["first"]
            for key, value in txn.cursor():
                i = fmt.decode_key(key)
                if i != expected:
                    yield f"{name}: key {i} found where key {expected} was expected"
                    expected = i
                crcs.append(zlib.crc32(value))
                sizes.append(len(value))
                problem = _check_record(i, value, crcs[-1], index, decode)
                if problem:
                    yield f"{name}: key {i}: {problem}"
                if tick is not None:
                    tick(1)
                expected += 1
            last = entry["first"] + entry["count"] - 1
            if expected - 1 != last:
                yield f"{name}: ends at key {expected - 1}, expected key {last}"
    finally:
        env.close()


def _check_record(i: int, value: bytes, crc: int, index: np.ndarray, decode: bool) -> str | None:
    if not 0 <= i < len(index):
        return "key outside the index"
    row = index[i]
    if len(value) != row["nbytes"] or crc != row["crc32"]:
        return "record bytes differ from those recorded at build time (CRC-32 mismatch)"
    try:
        rec = unpack_record(value)
        img = image_bytes(rec) if decode else b""
    except Exception as e:  # msgpack and zstd raise several types
        return f"record does not unpack: {type(e).__name__}: {e}"
    if rec["label"] != row["label"]:
        return f"label {rec['label']} differs from the index ({row['label']})"
    if not decode:
        return None
    pixels = cv2.imdecode(np.frombuffer(img, np.uint8), cv2.IMREAD_UNCHANGED)
    if pixels is None or pixels.shape[:2] != (rec["height"], rec["width"]):
        return f"image does not decode to {rec['width']}x{rec['height']} ({rec['path']})"
    return None
