"""Hostile data the converter's and the loader's tests share: small photo trees and
stores, doctored JPEG and PNG bytes, and stores damaged or forged on disk as a forger
would (the index's and shards' checksums and sizes rewritten to match)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
from fixtures import REPO

from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.format.codec import pack_record, unpack_record
from ingest.format.pages import open_lmdb
from loader.bench.synth import make_image_folder
from loader.store import Store

HANG_S = 90  # the random-damage tests take a fifth of this; a hang fails the test, not the suite
KiB = 1 << 10


@contextlib.contextmanager
def fails_if_hung(seconds: int):
    """Raise TimeoutError in the main thread if the block is still running after
    ``seconds`` (SIGALRM; the handler before is put back)."""

    def hung(*_):
        raise TimeoutError(f"the test hung: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def tree(root: Path, classes: int = 2, per_class: int = 3) -> Path:
    """A small ImageFolder tree of real-photo JPEGs: ``classes x per_class`` images."""
    make_image_folder(root, classes, per_class, short_side=(48, 72))
    return root


def small_store(root: Path) -> Path:
    """12 images in 3 classes, 4 shards, built under ``root``; its path."""
    build(tree(root / "src", 3, 4), root / "store", BuildOptions(shard_size=10 * KiB),
          workers=1, progress=False)  # fmt: skip
    assert len(fmt.read_manifest(root / "store")["shards"]) == 4
    return root / "store"


def small_jpeg() -> bytes:
    photo = cv2.imread(str(REPO / "loader" / "bench" / "samples" / "Elephants.jpg"))
    return cv2.imencode(".jpg", cv2.resize(photo, (64, 48)))[1].tobytes()


def claiming(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` with a frame header that claims ``width`` x ``height`` pixels."""
    sof = jpeg.find(b"\xff\xc0")
    return jpeg[: sof + 5] + struct.pack(">HH", height, width) + jpeg[sof + 9 :]


def rewrite_index(store: Path, edit, checksum: bool = True) -> None:
    """Edit the index; with ``checksum``, its sha256 in the manifest follows (a forger's)."""
    index = np.array(fmt.load_index(store, mmap=False))
    edit(index)
    np.save(store / fmt.INDEX, index)
    if checksum:
        manifest = json.loads((store / fmt.MANIFEST).read_text())
        manifest["index"]["sha256"] = hashlib.sha256((store / fmt.INDEX).read_bytes()).hexdigest()
        (store / fmt.MANIFEST).write_text(json.dumps(manifest))


def rewrite_record(store: Path, i: int, change) -> None:
    """Rewrite record ``i`` as ``change(record)`` says, consistently: its index CRC-32 and
    size and its shard's size in the manifest follow, as a deliberate forger's would."""

    def rewritten(old: bytes) -> bytes:
        record = unpack_record(old)
        change(record)
        return pack_record(record)

    value = put_value(store, i, rewritten)
    rewrite_index(
        store, lambda ix: ix[["crc32", "nbytes"]].__setitem__(i, (zlib.crc32(value), len(value)))
    )


def put_value(store: Path, i: int, rewritten) -> bytes:
    """Store ``rewritten(old value)`` as record ``i`` and return it; its shard's size in the
    manifest follows."""
    shard = Store(store).shard_of(i)
    env = open_lmdb(store / fmt.shard_name(shard), subdir=True, lock=False, map_size=1 << 31)
    with env, env.begin(write=True) as txn:
        value = rewritten(txn.get(fmt.encode_key(i)))
        txn.put(fmt.encode_key(i), value)
    manifest = json.loads((store / fmt.MANIFEST).read_text())
    manifest["shards"][shard]["file_bytes"] = (
        (store / fmt.shard_name(shard) / "data.mdb").stat().st_size
    )
    (store / fmt.MANIFEST).write_text(json.dumps(manifest))
    return value


def png_chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(png):
        (length,) = struct.unpack_from(">I", png, pos)
        chunks.append((png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return chunks


def png_of(chunks) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        for kind, body in chunks
    )


def damage_last_leaf_page(shard: Path) -> int:
    """Point the first node of the shard's last leaf page 64 KiB past the page, in place
    (the file's size unchanged), and return that page's number: unchecked, LMDB reads past
    the end of the file and dies of SIGBUS."""
    path = shard / "data.mdb"
    data = bytearray(path.read_bytes())
    page, leaves = struct.unpack_from("<I", data, 40)[0], []  # the first meta page's size
    k = 2  # pages 0 and 1 are the meta pages
    while (k + 1) * page <= len(data):
        flags, ovpages = struct.unpack_from("<H", data, k * page + 10)[0], 1
        if flags & 0x04:  # an overflow page: a record's value over this many pages
            ovpages = struct.unpack_from("<I", data, k * page + 12)[0]
        elif flags & 0x02:
            leaves.append(k)
        k += max(1, ovpages)
    struct.pack_into("<H", data, leaves[-1] * page + 16, 0xFFFF)
    path.write_bytes(bytes(data))
    return leaves[-1]
