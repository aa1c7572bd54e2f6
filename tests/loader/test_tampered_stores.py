"""Stores tampered with on disk, read by the loader: nothing hangs, nothing crashes,
nothing lies.

Truncated shards, edited manifests and indexes, flipped bytes, malformed and forged
records, pixel limits, damaged PNGs and LMDB pages, a rebuild under an open loader (the
converter's side, hostile source trees and `ingest verify`: tests/ingest/
test_hostile_inputs.py). Every test runs under an alarm: a hang fails it instead of the
suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import time
import zlib
from pathlib import Path

import cv2
import lmdb
import msgpack
import numpy as np
import pytest
from fixtures import run_ingest, run_python
from hostile_data import (
    HANG_S,
    claiming,
    damage_last_leaf_page,
    fails_if_hung,
    png_chunks,
    png_of,
    put_value,
    rewrite_index,
    rewrite_record,
    small_jpeg,
    small_store,
    tree,
)

import loader
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.format.codec import record_limit
from ingest.images.probe import PngError, parse_jpeg, plain_png
from ingest.verify import verify_store
from loader import LMDBDataset
from loader.bench.synth import make_image_folder
from loader.store import Store


@pytest.fixture(autouse=True)
def no_hang():
    with fails_if_hung(HANG_S):
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """12 images in 3 classes, 4 shards; read it, never change it (copy it first)."""
    return small_store(tmp_path_factory.mktemp("hostile"))


@pytest.fixture
def copy(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "copy")
    return tmp_path / "copy"


def _run_python(script: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``script`` in a new interpreter (its own fd 2), this repository importable; it
    must succeed."""
    run = run_python("-c", script, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run


def test_a_stored_jpeg_that_warns_fails_verify_and_is_replaced_in_training(tmp_path: Path):
    src = tree(tmp_path / "src")
    (src / "class_01" / "claims.jpg").write_bytes(claiming(small_jpeg(), 800, 600))
    out = tmp_path / "out"
    build(src, out, BuildOptions(verify=False), workers=1, progress=False)  # kept unchecked
    bad = LMDBDataset(out).samples.index(("class_01/claims.jpg", 1))
    verify = run_ingest("verify", out)
    assert verify.returncode == 1
    assert (
        f"shard-00000: key {bad}: corrupt JPEG data: the decoder warns: premature end of data "
        "segment (class_01/claims.jpg)"
    ) in verify.stderr
    script = (
        "import loader\n"
        f"dl = loader.DataLoader({str(out)!r}, batch_size=7, transform='eval', device='cpu', "
        "seed=0)\n"  # a seed: the replacement drawn must not be the bad sample again
        "for epoch in range(2):\n"
        "    n = sum(len(labels) for _, labels in dl)\n"
        "print(n, dl.num_replaced, sorted(dl.bad_samples))\n"
    )
    run = _run_python(script, timeout=60)
    assert run.stdout == f"7 2 [{bad}]\n"  # replaced each epoch, counted twice
    lines = run.stderr.splitlines()  # once, by the loader; nothing straight from libjpeg
    assert len(lines) == 1 and lines[0].startswith(f"DataLoader: sample {bad} (class_01/claims")


def test_a_record_over_the_pixel_limit_is_refused_before_decoding(copy: Path):
    index = fmt.load_index(copy)
    pixels = index["height"].astype(int) * index["width"].astype(int)
    big = int(np.argmax(pixels))
    assert (pixels == pixels[big]).sum() == 1
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["options"]["max_pixels"] = int(pixels[big]) - 1
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))  # as if built with a lower limit
    message = (
        f"{index[big]['width']}x{index[big]['height']} pixels is over the pixel limit of "
        f"{pixels[big] - 1} (a decompression bomb?); rebuild the store"
    )
    with pytest.raises(fmt.RecordError, match=re.escape(message)):
        LMDBDataset(copy)[big]
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [big] and dl.num_replaced == 1
    assert dl.bad_samples[big].endswith(message)


# -- a store read from disk is untrusted input ---------------------------------------------


def test_a_truncated_shard_is_a_store_error_not_sigbus(copy: Path):
    shard = copy / "shard-00001" / "data.mdb"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    message = (
        f"{shard}: {size // 2} bytes where the manifest records {size} (truncated or "
        "replaced); the store is damaged: rebuild it"
    )
    first = fmt.read_manifest(copy)["shards"][1]["first"]
    with pytest.raises(fmt.StoreError, match=rf"^{re.escape(message)}$"):
        LMDBDataset(copy)[first]
    with pytest.raises(fmt.StoreError, match=r"shard-00001/data.mdb: \d+ bytes where"):
        list(loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0))
    result = run_ingest("verify", copy)
    assert result.returncode == 1  # not -SIGBUS
    assert f"ingest verify: {copy}/shard-00001/data.mdb: {size // 2} bytes where" in result.stderr


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "../../../../etc",
            r"shard 1 is named '../../../../etc', where the format says 'shard-00001'",
        ),
        ("/etc", r"shard 1 is named '/etc', where the format says 'shard-00001'"),
        ("shard-00003", r"shard 1 is named 'shard-00003', where the format says 'shard-00001'"),
    ],
)
def test_shard_names_in_the_manifest_cannot_point_elsewhere(copy: Path, name: str, match: str):
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["shards"][1]["name"] = name
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    for reader in (verify_store, Store, LMDBDataset):
        with pytest.raises(fmt.StoreError, match=match):
            reader(copy)
    result = run_ingest("verify", copy)
    assert result.returncode == 2 and result.stderr.count("\n") == 1


@pytest.mark.parametrize("what", [fmt.INDEX, fmt.PATHS])
def test_index_or_paths_replaced_by_a_fifo_or_a_device_never_hangs(copy: Path, what: str):
    (copy / what).unlink()
    os.mkfifo(copy / what)
    problem = f"{what}: a FIFO (named pipe), not a regular file; rebuild the store"
    assert verify_store(copy)[0] == problem
    with pytest.raises(fmt.StoreError, match=rf"{what}: a FIFO \(named pipe\), not a regular"):
        LMDBDataset(copy).samples  # noqa: B018 (the index is read on open, the paths here)
    (copy / what).unlink()
    os.symlink("/dev/zero", copy / what)
    with pytest.raises(fmt.StoreError, match=rf"{what}: leads outside the store \(to /dev/zero\)"):
        LMDBDataset(copy).samples  # noqa: B018


def test_a_version_1_store_still_reads(copy: Path):
    """Version 1 recorded no build identity, file sizes or pixel limit: those checks are
    skipped, the others apply."""
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["version"] = 1
    del manifest["build"], manifest["options"]["max_pixels"]
    for key in ("index", "paths", "rejects"):
        del manifest[key]["bytes"]
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    assert verify_store(copy) == []  # before a reader opens the shards in this process
    ds = LMDBDataset(copy)
    assert [ds[i][1] for i in range(len(ds))] == fmt.load_index(copy)["label"].tolist()
    assert ds.store.max_pixels == fmt.DEFAULT_MAX_PIXELS


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.__setitem__("shards", [1, 2, 3, 4]), r"shard 0 is not a JSON object"),
        (lambda m: m["shards"].__setitem__(1, None), r"shard 1 is not a JSON object"),
        (lambda m: m.__setitem__("build", "\u00e9\ud800"), r"'build' is missing or not a hex"),
        (None, r"not valid JSON"),
        (lambda m: m["options"].__setitem__("max_pixels", 0), r"'options.max_pixels' is not a p"),
        (lambda m: m["options"].__setitem__("max_pixels", True), r"'options.max_pixels' is not"),
    ],
    ids=["shards-ints", "shard-null", "build-not-hex", "deep", "no-pixels", "pixels-bool"],
)
def test_a_manifest_of_the_wrong_shape_is_one_line(copy: Path, edit, match):
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    if edit is not None:
        edit(manifest)
    text = json.dumps(manifest)
    if edit is None:  # a value nested 100,000 deep: the JSON parser's recursion runs out
        text = text[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (copy / fmt.MANIFEST).write_text(text)
    for reader in (verify_store, Store, LMDBDataset):
        with pytest.raises(fmt.StoreError, match=match):
            reader(copy)
    result = run_ingest("verify", copy)
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_paths_that_are_not_paths_are_refused_and_never_kill_a_run(copy: Path):
    """A paths file of numbers (its size and checksum rewritten): reading the paths is a
    one-line error; a bad sample meanwhile is still only replaced (its message says the
    path is unknown), not the end of the run."""
    data = msgpack.packb(list(range(12)))
    (copy / fmt.PATHS).write_bytes(data)
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["paths"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fmt.StoreError, match=r"paths.msgpack: an entry is not a path"):
        _ = Store(copy).paths
    rewrite_record(copy, 2, lambda record: record.__setitem__("image", 12345))
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 12 and dl.num_replaced == 1
    assert "its path unknown" in dl.bad_samples[2]


def test_a_record_whose_path_is_not_a_path_is_malformed(copy: Path):
    rewrite_record(copy, 2, lambda record: record.__setitem__("path", 7))
    with pytest.raises(fmt.RecordError, match=r"field 'path' is int, not str"):
        Store(copy).record(2)
    problems = verify_store(copy)
    assert problems == [
        "shard-00000: key 2: malformed record: field 'path' is int, not str",
        "shard-00000: content checksum mismatch (records changed since the build)",
    ]


def _allow_pixels(store: Path, limit: int) -> None:
    manifest = json.loads((store / fmt.MANIFEST).read_text())
    manifest["options"]["max_pixels"] = limit
    (store / fmt.MANIFEST).write_text(json.dumps(manifest))


def _limit_message(store: Path, i: int, size: str, pixels: int, reader: int, allows) -> str:
    allows = "records no limit" if allows is None else f"allows {allows}"
    return (
        f"{store}/index.npy: sample {i} is {size} ({pixels} pixels), over the reader's limit "
        f"of {reader} (the store {allows}); if you trust the store, raise the limit to "
        f"{pixels} (max_pixels={pixels} in Python, ingest verify --max-pixels {pixels})"
    )


def _refused_by_every_reader(store: Path, message: str, **limit) -> None:
    opens = (Store, LMDBDataset, verify_store,
             lambda p, **kw: loader.DataLoader(p, transform="eval", **kw))  # fmt: skip
    for open_it in opens:
        with pytest.raises(fmt.PixelLimitError, match=rf"^{re.escape(message)}$"):
            open_it(store, **limit)
    flag = [f"--max-pixels={limit['max_pixels']}"] if limit else []
    run = run_ingest("verify", str(store), *flag)
    assert (run.returncode, run.stderr) == (2, f"ingest verify: error: {message}\n")


def test_a_store_cannot_raise_the_readers_pixel_limit(copy: Path):
    """A store from elsewhere that allows a trillion pixels and holds a 30000x30000 image
    is refused at open, by every reader, with what to pass to trust it; it is not left
    to cost minutes at one sample."""
    _allow_pixels(copy, 10**12)
    row = fmt.load_index(copy)[5]
    size = f"{row['width']}x{row['height']} pixels"
    rewrite_index(copy, lambda ix: ix[["height", "width"]].__setitem__(5, (30000, 30000)))
    message = _limit_message(copy, 5, "30000x30000", 900_000_000, 178_956_970, 10**12)
    _refused_by_every_reader(copy, message)
    # Trusted: the limit is the reader's, and the image, whose JPEG is not 30000x30000,
    # is one bad sample.
    store = Store(copy, max_pixels=900_000_000)
    assert store.max_pixels == 900_000_000
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0,
                           max_pixels=900_000_000)  # fmt: skip
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [5] and dl.num_replaced == 1
    assert dl.bad_samples[5].startswith("class_01/img_00001.JPEG: damaged record: ")
    assert dl.bad_samples[5].endswith(
        f"key 5: the JPEG header gives {size}, the index 30000x30000; check the store with "
        f"`ingest verify {copy}` and rebuild it"
    )
    shard = fmt.shard_name(store.shard_of(5))  # verify, as it advises, finds it too
    assert verify_store(copy, max_pixels=900_000_000) == [
        f"{shard}: key 5: the JPEG header gives {size}, the index 30000x30000"
    ]


def test_the_pixel_limit_at_open_without_overflow_and_within_what_the_store_allows(copy):
    """Heights and widths are 32-bit: their product is taken without wrapping (a row of
    4e9 x 4e9 wrapped to a negative count in int64 and opened). A row over the store's own
    limit is damaged, refused as it is read, and not what the open-time message asks to
    allow (a value that would not have helped)."""
    _allow_pixels(copy, 10**20)
    rewrite_index(copy, lambda ix: ix[["height", "width"]].__setitem__(5, (4 * 10**9,) * 2))
    pixels = 16 * 10**18
    _refused_by_every_reader(
        copy, _limit_message(copy, 5, "4000000000x4000000000", pixels, 178_956_970, 10**20)
    )
    _allow_pixels(copy, 10**9)  # the row is now over what the store allows: damaged
    assert Store(copy).max_pixels == 178_956_970
    with pytest.raises(fmt.RecordError, match="4000000000x4000000000 pixels is over the pixel "
                       "limit of 178956970"):  # fmt: skip
        Store(copy).image(5)


def test_a_version_1_store_records_no_limit_and_takes_the_readers(copy: Path):
    """Before version 2 stores recorded no pixel limit: the reader's applies, raised or
    not (a higher one was ignored, and a larger image lost sample by sample with the
    advice to rebuild)."""
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["version"] = 1
    del manifest["build"], manifest["options"]["max_pixels"]
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    rewrite_index(copy, lambda ix: ix[["height", "width"]].__setitem__(5, (20000, 20000)))
    message = _limit_message(copy, 5, "20000x20000", 400_000_000, 178_956_970, None)
    _refused_by_every_reader(copy, message)
    assert Store(copy, max_pixels=10**9).max_pixels == 10**9
    with pytest.raises(fmt.RecordError, match=r"the JPEG header gives .*, the index 20000x20000"):
        Store(copy, max_pixels=10**9).image(5)


def test_a_reader_may_lower_the_pixel_limit(copy: Path):
    index = fmt.load_index(copy)
    pixels = index["height"].astype(int) * index["width"].astype(int)
    big = int(np.argmax(pixels))
    largest = int(pixels[big])
    size = f"{index[big]['width']}x{index[big]['height']}"
    message = _limit_message(copy, big, size, largest, largest - 1, 178_956_970)
    _refused_by_every_reader(copy, message, max_pixels=largest - 1)
    assert Store(copy).max_pixels == 178956970  # the store's own, the lower
    assert Store(copy, max_pixels=np.int64(largest)).max_pixels == largest
    assert verify_store(copy, max_pixels=largest) == []
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0,
                           max_pixels=largest)  # fmt: skip
    assert sum(len(labels) for _, labels in dl) == 12 and not dl.bad_samples
    for bad in (0, -1, True, 1.5, "big"):
        with pytest.raises(ValueError, match=re.escape(f"max_pixels={bad!r}: give a positive")):
            Store(copy, max_pixels=bad)
    with pytest.raises(ValueError, match=r"^max_pixels= cannot be given with an LMDBDataset"):
        loader.DataLoader(LMDBDataset(copy), transform="eval", max_pixels=largest)


def test_a_record_larger_than_its_image_can_need_is_refused_unread(copy: Path):
    """A forger's record of 68 MB behind a 4 KB image (its index entry, CRC-32 and
    checksums rewritten to match): refused from the index before it is read, a bad
    sample, not 68 MB copied at every epoch."""
    row = fmt.load_index(copy)[2]
    height, width = int(row["height"]), int(row["width"])
    padding = bytes(record_limit(height, width))
    rewrite_record(copy, 2, lambda record: record.update(pad=padding))
    nbytes = int(fmt.load_index(copy)[2]["nbytes"])
    assert nbytes > record_limit(height, width)
    message = (
        f"key 2: a record of {nbytes} bytes is more than an image of {width}x{height} pixels "
        "needs; rebuild the store"
    )
    with pytest.raises(fmt.RecordError, match=re.escape(message)):
        Store(copy).image(2)
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [2] and dl.bad_samples[2].endswith(message)
    assert verify_store(copy)[0] == (
        f"shard-00000: key 2: a record of {nbytes} bytes is more than an image of "
        f"{width}x{height} pixels needs"
    )


def test_a_value_longer_than_its_index_entry_is_refused_before_it_is_copied(copy: Path):
    """The index (checksummed) says how long each record is; a shard value of another
    length is refused from the mapped pages, before a copy of it is made."""
    put_value(copy, 2, lambda old: bytes(1 << 20))
    nbytes = int(fmt.load_index(copy)[2]["nbytes"])
    with pytest.raises(
        fmt.RecordError,
        match=re.escape(
            f"key 2: the record is 1048576 bytes, the index says {nbytes}; check the store"
        ),
    ):
        Store(copy).image(2)


def test_an_index_edited_within_its_bounds_is_refused_on_open(copy: Path):
    """A label changed to another valid one (a flipped bit): every check of the index's
    shape passes, and the loader would deliver the sample with the wrong label; its
    checksum in the manifest tells."""
    rewrite_index(copy, lambda ix: ix["label"].__setitem__(5, (ix["label"][5] + 1) % 3), False)
    for reader in (Store, LMDBDataset):
        with pytest.raises(fmt.StoreError, match=r"index.npy: checksum mismatch"):
            reader(copy).index if reader is Store else reader(copy)
    with pytest.raises(fmt.StoreError, match=r"index.npy: checksum mismatch"):
        loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu")


def test_a_record_whose_label_differs_from_the_index_is_a_bad_sample(copy: Path):
    """The index and its checksum rewritten (a forger's), the record's own label left:
    the two disagree, and the sample is replaced, never delivered with either label."""
    rewrite_index(copy, lambda ix: ix["label"].__setitem__(5, (ix["label"][5] + 1) % 3))
    with pytest.raises(fmt.RecordError, match=r"key 5: label \d differs from the index's"):
        Store(copy).record(5)
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [5] and dl.num_replaced == 1


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda ix: ix["label"].__setitem__(3, -5),
            r"row 3 has an invalid label \(-5; 1 such rows\)",
        ),
        (
            lambda ix: ix["label"].__setitem__(4, 2**31 - 1),
            r"row 4 has an invalid label \(2147483647; 1 such rows\)",
        ),
        (
            lambda ix: ix["shard"].__setitem__(0, 3),
            r"row 0 has an invalid shard \(3; 1 such rows\)",
        ),
    ],
)
def test_an_index_inconsistent_with_the_manifest_is_refused_on_open(copy: Path, edit, match):
    rewrite_index(copy, edit)
    for reader in (Store, LMDBDataset):
        with pytest.raises(fmt.StoreError, match=match):
            reader(copy)


def test_a_garbled_index_is_refused(copy: Path):
    data = bytearray((copy / fmt.INDEX).read_bytes())
    data[20:40] = b"}garbled{" + bytes(11)
    (copy / fmt.INDEX).write_bytes(bytes(data))
    with pytest.raises(fmt.StoreError, match=r"index.npy: not a valid index \("):
        Store(copy)


def test_a_lowered_sample_count_is_refused(copy: Path):
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["num_samples"] = 10
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fmt.StoreError, match=r"index.npy: 12 rows, but the manifest counts 10"):
        LMDBDataset(copy)


def _flip(store: Path, i: int) -> None:
    """Flip 16 bytes inside record ``i``'s JPEG data, in place in its shard file."""
    shard = store / fmt.shard_name(Store(store).shard_of(i)) / "data.mdb"
    image = Store(store).record(i)["image"]
    data = bytearray(shard.read_bytes())
    at = data.find(image) + len(image) // 2
    for k in range(16):
        data[at + 7 * k] ^= 0x5A
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_flipped_bytes_fail_the_crc_and_are_replaced_counted(copy: Path, num_workers: int):
    _flip(copy, 9)
    shard = fmt.shard_name(Store(copy).shard_of(9))
    with pytest.raises(fmt.RecordError, match=rf"{shard}: key 9: the record's bytes differ"):
        LMDBDataset(copy)[9]
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0,
                           num_workers=num_workers, with_indices=True)  # fmt: skip
    got = [int(i) for _, _, indices in dl for i in indices]
    assert len(got) == 12 and 9 not in got
    assert list(dl.bad_samples) == [9] and dl.num_replaced == 1
    assert "CRC-32 mismatch" in dl.bad_samples[9]


def test_a_malformed_record_is_a_bad_sample(copy: Path):
    """A record rewritten consistently (index CRC and shard size updated) but whose image
    is not bytes: only the schema check catches it."""
    rewrite_record(copy, 2, lambda record: record.__setitem__("image", 12345))
    with pytest.raises(fmt.RecordError, match=r"malformed record: field 'image' is int, not bytes"):
        LMDBDataset(copy)[2]
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [2] and dl.num_replaced == 1


def _header_says(size: tuple[int, int] | None):
    """A change for ``rewrite_record``: the JPEG's frame header gives ``size`` (height,
    width) instead of its own, or (None) its frame header is gone."""

    def change(record: dict) -> None:
        data = bytearray(record["image"])
        at = parse_jpeg(bytes(data)).scan  # the frame header lies before the first scan
        sof = max(data.rfind(bytes([0xFF, m]), 0, at) for m in (0xC0, 0xC1, 0xC2))
        if size is None:
            data[sof + 1] = 0xE5  # an application segment of the same length instead
        else:
            struct.pack_into(">HH", data, sof + 5, *size)
        record["image"] = bytes(data)

    return change


@pytest.mark.parametrize(
    ("size", "says"),
    [
        ((40_000, 40_000), "40000x40000 pixels"),
        ((100, 50), "50x100 pixels"),
        (None, "no readable size"),
    ],
    ids=["bomb", "smaller", "no-frame-header"],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_image_whose_header_disagrees_with_the_index_is_never_decoded(
    copy: Path, size, says, num_workers
):
    """A record rewritten consistently whose JPEG says another size than the index: a
    decompression bomb behind a small index entry (40000x40000 would take 4.8 GB to
    decode), a smaller image, no size at all. Every decoder sizes its work from the
    index, so the header is checked against it first; a bad sample, replaced."""
    stated = Store(copy).index[5]
    rewrite_record(copy, 5, _header_says(size))
    index_says = f"the index {stated['width']}x{stated['height']}"
    with pytest.raises(
        fmt.RecordError, match=rf"key 5: the JPEG header gives {says}, {index_says}"
    ):
        LMDBDataset(copy)[5]
    dl = loader.DataLoader(copy, batch_size=4, transform="train", device="cpu", seed=0,
                           num_workers=num_workers)  # fmt: skip
    assert sum(len(labels) for _, labels in dl) == 12
    assert list(dl.bad_samples) == [5] and dl.num_replaced == 1
    assert f"the JPEG header gives {says}" in dl.bad_samples[5]
    shard = fmt.shard_name(Store(copy).shard_of(5))
    assert verify_store(copy) == [
        f"{shard}: key 5: the JPEG header gives {says}, {index_says}",
        f"{shard}: content checksum mismatch (records changed since the build)",
    ]


def test_a_store_rebuilt_while_open_is_an_error_not_a_mix(tmp_path: Path):
    first, second = tree(tmp_path / "a", 2, 4), tmp_path / "b"
    make_image_folder(second, 2, 4, seed=9, short_side=(48, 72))
    out = tmp_path / "store"
    assert run_ingest("build", first, out, "--shard-size", "8KiB").returncode == 0
    ds = LMDBDataset(out)
    dl = loader.DataLoader(out, batch_size=4, transform="eval", device="cpu")
    rebuilt = run_ingest("build", second, out, "--shard-size", "8KiB", "--overwrite")
    assert rebuilt.returncode == 0
    assert len(LMDBDataset(out)) == len(ds) == 8  # the same number of samples
    match = r"written by another build than the store's manifest \(the store was rebuilt"
    with pytest.raises(fmt.StoreError, match=match):
        ds[0]
    with pytest.raises(fmt.StoreError, match=match):
        list(dl)


@pytest.mark.parametrize("read_before", ["manifest", "manifest and index"])
def test_a_store_rebuilt_while_it_is_opened_says_so(tmp_path: Path, monkeypatch, read_before):
    """A store rebuilt after a reader read its manifest (and index), before it walked the
    shards: the files refused are named as rebuilt, with what to do (it said "truncated or
    replaced")."""
    first, second = tree(tmp_path / "a", 2, 4), tmp_path / "b"
    make_image_folder(second, 2, 4, seed=9, short_side=(48, 72))
    out = tmp_path / "store"
    assert run_ingest("build", first, out, "--shard-size", "8KiB").returncode == 0
    old = Store(out)
    assert run_ingest("build", second, out, "--shard-size", "8KiB", "--overwrite").returncode == 0
    stale = iter([old.manifest])
    real_read = fmt.read_manifest
    monkeypatch.setattr(fmt, "read_manifest", lambda root: next(stale, None) or real_read(root))
    if read_before == "manifest and index":
        monkeypatch.setattr(fmt, "load_index", lambda root, manifest: old.index)
    where = "index.npy" if read_before == "manifest" else "shard-00000"
    with pytest.raises(fmt.StoreError, match=rf"{where}: written by another build than the "
                       r"store's manifest \(the store was rebuilt or changed since it was "
                       r"opened\); open the store again"):  # fmt: skip
        Store(out)
    assert len(Store(out)) == 8  # opened again: the new store


def test_a_spawned_worker_of_a_store_rebuilt_since_says_so(tmp_path: Path):
    """A spawned worker receives the store without its index and loads it again: after a
    rebuild, that said "checksum mismatch; the store is damaged or was edited"."""
    first, second = tree(tmp_path / "a", 2, 4), tmp_path / "b"
    make_image_folder(second, 2, 4, seed=9, short_side=(48, 72))
    out = tmp_path / "store"
    assert run_ingest("build", first, out, "--shard-size", "8KiB").returncode == 0
    sent = pickle.dumps(Store(out))  # what a spawned worker is given
    assert run_ingest("build", second, out, "--shard-size", "8KiB", "--overwrite").returncode == 0
    worker = pickle.loads(sent)
    with pytest.raises(fmt.StoreError, match=r"index.npy: written by another build than the "
                       r"store's manifest \(the store was rebuilt"):  # fmt: skip
        _ = worker.index


def test_a_rebuild_of_equal_size_is_caught_by_the_build_identity(tmp_path: Path):
    src, out = tree(tmp_path / "src"), tmp_path / "store"
    build(src, out, workers=1, progress=False)
    ds = LMDBDataset(out)
    os.utime(src / "class_00" / "img_00000.JPEG", ns=(1, 1))  # new inputs, the same bytes
    assert run_ingest("build", src, out, "--overwrite", "--workers", "1").returncode == 0
    entry = fmt.read_manifest(out)["shards"][0]
    assert entry["file_bytes"] == ds.store.manifest["shards"][0]["file_bytes"]  # sizes agree
    assert fmt.read_manifest(out)["build"] != ds.store.manifest["build"]
    with pytest.raises(fmt.StoreError, match=r"shard-00000: written by another build than"):
        ds[0]


# -- also ---------------------------------------------------------------------------------


def _stop_self(worker_id: int) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def test_timeout_is_honoured_with_a_stopped_worker(store: Path):
    dl = loader.DataLoader(store, batch_size=4, transform="eval", device="cpu", num_workers=1,
                           worker_init_fn=_stop_self, timeout=1.0)  # fmt: skip
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 1.0 seconds"):
        next(iter(dl))
    assert time.monotonic() - start < 3.0  # 1 s, plus stopping the worker: not 5 s more


def _damaged_pngs(pixels: np.ndarray) -> tuple[bytes, dict[str, bytes]]:
    """A PNG of ``pixels``, and copies libpng warns about or refuses."""
    png = cv2.imencode(".png", pixels)[1].tobytes()
    chunks = png_chunks(png)
    profile = (b"iCCP", b"prof\x00\x00" + zlib.compress(b"not a profile"))
    half = [(k, b[: len(b) // 2]) if k == b"IDAT" else (k, b) for k, b in chunks]
    flipped = bytearray(png)
    flipped[len(png) // 2] ^= 0x55  # inside the image data: its CRC no longer holds
    return png, {
        "profile": png_of([chunks[0], profile, *chunks[1:]]),  # a warning, good pixels
        "truncated": png_of(half),
        "flipped": bytes(flipped),
    }


def test_damaged_pngs_give_the_same_samples_whatever_decodes_them_and_nothing_on_fd2(copy):
    """libpng warns about a bad colour profile and prints its errors itself; in the
    training process (num_workers=0) nothing could keep that off the terminal, and a
    worker refused what the training process delivered. Each PNG is now checked before
    libpng reads it, and decoded from its critical chunks only: the bad profile's image
    is delivered with its pixels, the damaged ones are replaced, by workers or not."""
    for key, name, message in ((3, "profile", None), (4, "truncated", "not the"),
                               (5, "flipped", "bad CRC")):  # fmt: skip
        jpeg = Store(copy).image(key)[0]  # the sample's own pixels, as a PNG
        clean, damaged = _damaged_pngs(
            cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
        )
        data = damaged[name]
        if message is None:
            assert plain_png(data) == clean
        else:
            with pytest.raises(PngError, match=message):
                plain_png(data)
        rewrite_record(copy, key, lambda record, d=data: record.update(image=d, format="png"))
    script = (
        "import hashlib, loader, torch\n"
        f"for workers in (0, 2):\n"
        f"    dl = loader.DataLoader({str(copy)!r}, batch_size=4, transform='eval', "
        "device='cpu', seed=0, shuffle=False, num_workers=workers, with_indices=True)\n"
        "    got = {int(i): hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12]\n"
        "           for images, _, idx in dl for x, i in zip(images, idx)}\n"
        "    print(workers, sorted(dl.bad_samples), got[3])\n"
        "    assert all('the PNG is damaged' in why for why in dl.bad_samples.values())\n"
    )
    run = _run_python(script, timeout=120)
    zero, two = run.stdout.splitlines()
    assert zero.split()[1:] == two.split()[1:] and zero.startswith("0 [4, 5] ")
    lines = run.stderr.splitlines()  # the loader's own line per bad sample, and no more
    assert len(lines) == 4 and all(line.startswith("DataLoader: sample ") for line in lines)
    assert "libpng" not in run.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_damaged_in_place_is_refused_before_lmdb_reads_it(copy: Path, workers: int):
    """LMDB trusts its pages: unchecked, this damage kills the process that reads the
    shard. Readers check the pages first (ingest.format.pages): at open, and in each process
    before it maps a shard whose file changed since; they raise the store's error, the
    same one line from a worker as from the training process; verify names the shard."""
    dl = loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu",
                           num_workers=workers)  # fmt: skip
    leaf = damage_last_leaf_page(copy / "shard-00001")  # damaged once the loader is open
    problem = f"damaged LMDB pages (page {leaf} has a node outside its node area)"
    message = rf"^{re.escape(f'{copy}/shard-00001/data.mdb: {problem}; rebuild the store')}$"
    with pytest.raises(fmt.StoreError, match=message):
        list(dl)
    with pytest.raises(fmt.StoreError, match=message):
        LMDBDataset(copy)  # refused when opened
    with pytest.raises(fmt.StoreError, match=message):
        loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu")
    assert verify_store(copy) == [f"shard-00001: {problem}; rebuild the store"]
    if workers:
        return
    result = run_ingest("verify", copy)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"ingest verify: {copy}/shard-00001: {problem}; rebuild the store",
        "ingest verify: 1 problem(s); rebuild the store",
    ]


# A child process damages the store at random, at fixed seeds: 1, 2 or 8 bytes anywhere
# in one shard's file, or (as a forger would, the manifest's checksum of the index
# rewritten to match) 1 to 3 fields of the index's rows; then it reads an epoch in a
# grandchild and checks the store with verify. It prints how many epochs read clean, read
# with samples replaced, or were refused with the store's error, and each seed where
# anything else happened.
_STORE_FUZZ = r"""
import hashlib, json, logging, os, random, shutil, signal, sys
from pathlib import Path
import numpy as np
import loader
from ingest import format as fmt
from ingest.verify import verify_store
store, work, what = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
logging.disable(logging.CRITICAL)  # the replaced samples' warnings
n = fmt.read_manifest(store)["num_samples"]
counts = {"clean": 0, "replaced": 0, "refused": 0, "wrong": []}
for seed in range(*map(int, sys.argv[4:6])):
    rng = random.Random(seed)
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(store, work)
    if what == "shard":
        shard = rng.choice(sorted(work.glob("shard-*"))) / "data.mdb"
        data = bytearray(shard.read_bytes())
        for _ in range(rng.choice([1, 2, 8])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        shard.write_bytes(data)
    else:
        index = np.load(work / "index.npy")
        for _ in range(rng.choice([1, 2, 3])):
            row, field = rng.randrange(n), rng.choice(index.dtype.names)
            low, high = np.iinfo(index.dtype[field]).min, np.iinfo(index.dtype[field]).max
            value = rng.choice([0, 1, 2, low, high, int(index[field][row]) + 1,
                                rng.randrange(low, high + 1)])
            index[field][row] = min(value, high)
        np.save(work / "index.npy", index)
        data = (work / "index.npy").read_bytes()
        manifest = json.loads((work / "manifest.json").read_text())
        manifest["index"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        (work / "manifest.json").write_text(json.dumps(manifest))
    r, w = os.pipe()
    if (pid := os.fork()) == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # whatever a C library would say
        signal.alarm(60)
        try:
            dl = loader.DataLoader(work, batch_size=4, transform="train", device="cpu", seed=0)
            said = ["read", sum(len(labels) for _, labels in dl), dl.num_replaced]
        except fmt.StoreError as e:
            said = ["refused", str(e)]
        except BaseException as e:
            said = ["raised", repr(e)]
        os.write(w, json.dumps(said).encode())
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    said = json.loads(os.read(r, 1 << 16) or json.dumps(["died", status]))
    os.close(r)
    try:
        found = verify_store(work, progress=False)
    except fmt.StoreError as e:
        found = [str(e)]
    if said[0] == "read" and said[1] == n and (said[2] == 0 or found):
        counts["replaced" if said[2] else "clean"] += 1
    elif said[0] == "refused" and found:
        counts["refused"] += 1
    else:
        counts["wrong"].append([seed, said, found])
print(json.dumps(counts))
"""


@pytest.mark.parametrize("what", ["shard", "index"])
def test_random_damage_never_kills_or_lies(store: Path, tmp_path: Path, what: str):
    """Whatever a few bytes damaged anywhere in a shard, or a few forged fields in the
    index, do, an epoch either reads every sample (a damaged one replaced and counted,
    and then verify finds the damage too: the loader's advice to run it never meets a
    store it calls sound) or stops with the store's one-line error (verify agrees);
    never a dead process, another error, a hang or a sample lost."""
    result = run_python(
        "-c", _STORE_FUZZ, store, tmp_path / "work", what, 0, 60, timeout=HANG_S - 5
    )
    assert result.returncode == 0, result.stderr[-2000:]
    counts = json.loads(result.stdout)
    assert counts["wrong"] == []
    assert counts["clean"] + counts["replaced"] + counts["refused"] == 60
    assert min(counts["clean"], counts["replaced"], counts["refused"]) > 0  # all exercised


def test_a_store_error_while_draining_stops_persistent_workers(store: Path, monkeypatch):
    """A worker's StoreError (a store rebuilt under a running loader) read while an epoch
    left early drains its batches in flight: the workers are stopped, as after any
    worker's failure, not kept with a stale batch, and the next epoch starts new ones."""
    dl = loader.DataLoader(store, batch_size=2, transform="eval", device="cpu",
                           num_workers=2, persistent_workers=True)  # fmt: skip
    it = iter(dl)
    next(it)
    pool = dl._workers.pool

    def rebuilt(timeout):
        raise fmt.StoreError(f"{store}/shard-00001: written by another build than the store's")

    monkeypatch.setattr(pool, "receive", rebuilt)
    it.close()  # the error ends the draining, not the close
    assert dl._workers.pool is None  # stopped: the batches in flight will never come
    assert sum(len(labels) for _, labels in dl) == 12


@pytest.mark.skipif(
    not hasattr(lmdb.Environment, "lib_version"), reason="the LMDB of py-lmdb < 3 opens it"
)
def test_a_shard_lmdb_will_not_open_is_a_store_error_not_bad_samples(copy: Path):
    """LMDB refuses a meta page whose free database has foreign flags. That is the whole
    shard, not one sample: no replacement can help, and readers say so."""
    path = copy / "shard-00002" / "data.mdb"
    data = bytearray(path.read_bytes())
    for meta in (0, struct.unpack_from("<I", data, 40)[0]):  # at 0 and one page on
        struct.pack_into("<H", data, meta + 44, 0x48)  # the free database's flags
    path.write_bytes(bytes(data))
    first = fmt.read_manifest(copy)["shards"][2]["first"]
    match = rf"^{re.escape(str(path.parent))}: LMDB cannot open the shard \(.*MDB_INVALID"
    with pytest.raises(fmt.StoreError, match=match):
        LMDBDataset(copy)[first]
    with pytest.raises(fmt.StoreError, match=match):
        list(loader.DataLoader(copy, batch_size=4, transform="eval", device="cpu", num_workers=2))
    (problem,) = verify_store(copy)
    assert problem.startswith("shard-00002: LMDB cannot read the shard: ")
