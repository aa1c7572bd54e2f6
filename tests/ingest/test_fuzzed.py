"""What a fuzz campaign of the converter's inputs found: files and folders it must take
as PIL and ImageFolder do, or refuse in one line, and a store every reader reads."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import run_ingest
from PIL import Image, ImageOps

import ingest.images.normalize as normalize
import loader
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.build.resume import OutputError
from ingest.build.scan import SourceError, scan
from ingest.images.probe import parse_jpeg, plain_png, walk_scans
from loader import LMDBDataset
from loader.bench.synth import make_image_folder
from loader.store import Store


def _tree(root: Path, classes: int = 2, per_class: int = 3) -> Path:
    make_image_folder(root, classes, per_class, short_side=(48, 72))
    return root


def _photo(size=(96, 64)) -> Image.Image:
    """A flat-coloured RGB image of ``size``: these tests are about structure, not pixels."""
    return Image.new("RGB", size, (30, 120, 200)).quantize(8).convert("RGB")


def _counts(manifest: dict) -> tuple[int, int, int, int]:
    return (manifest["num_seen"], manifest["num_samples"], manifest["num_rejected"],
            manifest["num_ignored"])  # fmt: skip


def _one(tmp_path: Path, name: str, data: bytes) -> tuple[Path, Path]:
    """A tree of two classes: ``name`` holding ``data`` in class a, one JPEG in class b."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    (src / "a" / name).write_bytes(data)
    _photo().save(src / "b" / "ok.jpg")
    return src, tmp_path / "out"


def test_a_class_folder_holding_a_manifest_json_is_a_class(tmp_path: Path):
    # A dataset's own metadata file named manifest.json made a whole class a "store": its
    # images dropped, counted nowhere, and the labels shifted against ImageFolder's.
    src = _tree(tmp_path / "src")
    (src / "class_01" / fmt.MANIFEST).write_text(json.dumps({"name": "my dataset"}))
    (src / "class_00" / "nested").mkdir()
    (src / "class_00" / "nested" / fmt.MANIFEST).write_text("not JSON at all")
    manifest = build(src, tmp_path / "out", workers=1, progress=False)
    assert manifest["classes"] == ["class_00", "class_01"]
    assert _counts(manifest) == (8, 6, 0, 2) and manifest["skipped"] == []
    # A store's manifest, or a damaged one beside a store's index, is still a store.
    (src / "old").mkdir()
    (src / "old" / fmt.MANIFEST).write_text(json.dumps({"format": fmt.FORMAT_NAME}))
    (src / "class_01" / "broken").mkdir()
    (src / "class_01" / "broken" / fmt.MANIFEST).write_text('{"format": "imfeed-lm')
    (src / "class_01" / "broken" / fmt.INDEX).write_bytes(b"")
    found = scan(src)
    assert found.classes == ["class_00", "class_01"]
    assert found.skipped == [
        ("old", "a store (ingest build output), not a class"),
        ("class_01/broken", "a store (ingest build output), not images"),
    ]


def test_a_fifo_named_manifest_json_does_not_hang_the_scan(tmp_path: Path):
    src = _tree(tmp_path / "src")
    os.mkfifo(src / "class_00" / fmt.MANIFEST)
    found = []  # opening a FIFO would wait for a writer forever: in a thread, bounded
    thread = threading.Thread(target=lambda: found.append(scan(src)), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        with open(src / "class_00" / fmt.MANIFEST, "w"):  # lets the scan go on, and fails
            pytest.fail("the scan opened a FIFO named manifest.json")
    assert found[0].classes == ["class_00", "class_01"] and len(found[0].items) == 6


def test_a_folder_past_path_max_is_skipped_with_the_reason(tmp_path: Path):
    src = _tree(tmp_path / "src", 1, 2)
    jpeg = next((src / "class_00").iterdir()).read_bytes()
    fd, depth = os.open(src / "class_00", os.O_RDONLY), 0
    try:
        while depth * 201 < 4200:  # 21 levels of 200 characters: past PATH_MAX (4096)
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd, depth = inner, depth + 1
        image = os.open("deep.jpg", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        os.write(image, jpeg)
        os.close(image)
    finally:
        os.close(fd)
    found = scan(src)
    assert len(found.items) == 2  # the deep image is not among them...
    ((where, reason),) = found.skipped  # ...and the folder it could not reach is said
    assert reason == "unreadable folder: File name too long"
    assert len(os.fsencode(src / where)) > 4000


def test_unreadable_source_and_output_are_one_line(tmp_path: Path, monkeypatch):
    src = _tree(tmp_path / "src")
    real = os.scandir

    def refused(path):
        if Path(path) == src:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.raises(SourceError) as e:
        scan(src)
    assert str(e.value) == (
        f"source {src} cannot be read (Permission denied); give this user access to it"
    )
    monkeypatch.setattr(os, "scandir", real)
    out = tmp_path / "out"

    def denied(claim):
        raise PermissionError(13, "Permission denied", str(claim.out))

    monkeypatch.setattr("ingest.build.outdir.Claim.take", denied)
    with pytest.raises(OutputError) as e:
        build(src, out, workers=1, progress=False)
    assert str(e.value) == (
        f"output {out}: this user may not write there (Permission denied: {out}); give it "
        "write access, or choose another folder"
    )


def test_what_the_system_refuses_is_one_line_from_the_cli(tmp_path: Path):
    long = tmp_path / ("a" * 300)
    for command in ("info", "verify"):
        result = run_ingest(command, long)
        assert (result.returncode, result.stderr) == (
            2, f"ingest {command}: error: {long}: File name too long\n"
        )  # fmt: skip
    result = run_ingest("build", _tree(tmp_path / "src"), long / "out", "--workers", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.endswith("File name too long\n") and "Traceback" not in result.stderr


def _png_with(chunk: tuple[bytes, bytes], pixels: Image.Image) -> bytes:
    buf = io.BytesIO()
    pixels.save(buf, "PNG")
    png = buf.getvalue()
    kind, body = chunk
    packed = struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return png[:33] + packed + png[33:]  # after IHDR


def test_a_png_whose_text_pil_refuses_is_stored_without_it(tmp_path: Path, monkeypatch):
    # A zTXt chunk that inflates past PIL's MAX_TEXT_CHUNK: kept whole, LMDBDataset (PIL)
    # raised on it in training, while the loader and `ingest verify` passed it.
    pixels = _photo((120, 80))
    text = (b"zTXt", b"Comment\x00\x00" + zlib.compress(b"A" * (8 << 20), 9))
    data = _png_with(text, pixels)
    with pytest.raises(ValueError, match="MAX_TEXT_CHUNK"):
        Image.open(io.BytesIO(data)).load()
    src, out = _one(tmp_path, "text.png", data)
    assert _counts(build(src, out, workers=1, progress=False)) == (2, 2, 0, 0)
    record = Store(out).record(0)
    assert record["image"] == plain_png(data)  # the critical chunks, as they were
    assert record["fixes"] == [f"png-ancillary-chunks-dropped:{12 + len(text[1])}"]
    image, label = LMDBDataset(out)[0]
    assert label == 0 and np.array_equal(np.asarray(image), np.asarray(pixels))
    # A store of an older converter holds the chunk: LMDBDataset reads around it.
    with monkeypatch.context() as m:
        m.setattr(normalize, "plain_png", lambda data: data)  # what converter 2 stored
        build(src, tmp_path / "older", workers=1, progress=False)
    assert Store(tmp_path / "older").record(0)["image"] == data
    image, label = LMDBDataset(tmp_path / "older")[0]
    assert label == 0 and np.array_equal(np.asarray(image), np.asarray(pixels))


def test_reject_reasons_are_the_same_in_every_build(tmp_path: Path):
    # PIL's message named the BytesIO's address: rejects.jsonl, and the manifest's digest
    # of it, differed from one build of the same files to the next.
    src, _ = _one(tmp_path, "sig_only.png", b"\x89PNG\r\n\x1a\n")
    digests = []
    for out in (tmp_path / "one", tmp_path / "two"):
        manifest = build(src, out, workers=1, progress=False)
        lines = (out / fmt.REJECTS).read_text().splitlines()
        assert [json.loads(line) for line in lines] == [{
            "path": "a/sig_only.png",
            "reason": "corrupt png: UnidentifiedImageError: cannot identify image file",
        }]  # fmt: skip
        digests.append(manifest["rejects"]["sha256"])
    assert digests[0] == digests[1]


def _exif(entry: bytes, extra: bytes = b"") -> bytes:
    """A little-endian TIFF block: IFD0 with one entry, then ``extra`` (at offset 26)."""
    return b"II*\x00" + struct.pack("<IH", 8, 1) + entry + struct.pack("<I", 0) + extra


_ORIENTATIONS = {  # how the tag is written: PIL's exif_transpose turns the image or not
    "short-6": (struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0), b""),
    "long-6": (struct.pack("<HHII", 0x0112, 4, 1, 6), b""),
    "short-two-values": (struct.pack("<HHIHH", 0x0112, 3, 2, 6, 3), b""),
    "rational-12/2": (struct.pack("<HHII", 0x0112, 5, 1, 26), struct.pack("<II", 12, 2)),
    "rational-6/0": (struct.pack("<HHII", 0x0112, 5, 1, 26), struct.pack("<II", 6, 0)),
    "text": (struct.pack("<HHI4s", 0x0112, 2, 4, b"abc\x00"), b""),
    "short-9": (struct.pack("<HHIHH", 0x0112, 3, 1, 9, 0), b""),
    "sbyte-6": (struct.pack("<HHI4b", 0x0112, 6, 1, 6, 0, 0, 0), b""),
    "double-6.0": (struct.pack("<HHII", 0x0112, 12, 1, 26), struct.pack("<d", 6.0)),
    "long-two-past-the-end": (struct.pack("<HHII", 0x0112, 4, 2, 1000), b""),
}
_TURNED = ("short-6", "long-6", "short-two-values", "rational-12/2", "sbyte-6", "double-6.0")


def _with_exif(kind: str, exif: bytes) -> bytes:
    pixels = _photo((160, 100))
    if kind == "png":
        return _png_with((b"eXIf", exif), pixels)
    buf = io.BytesIO()
    (pixels.convert("CMYK") if kind == "cmyk" else pixels).save(buf, "JPEG", quality=90)
    jpeg, segment = buf.getvalue(), b"Exif\x00\x00" + exif
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + jpeg[2:]


@pytest.mark.parametrize("kind", ["jpeg", "cmyk", "png"])
@pytest.mark.parametrize("form", list(_ORIENTATIONS))
def test_exif_orientation_is_taken_as_pil_takes_it(tmp_path: Path, kind: str, form: str):
    # A plain JPEG's orientation came from the build's own header parser (SHORT only), the
    # others' from PIL, whose warnings were taken for the decoder's: the same tag turned
    # one image and not another, or rejected it ("invalid literal for int()").
    data = _with_exif(kind, _exif(*_ORIENTATIONS[form]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size  # (width, height)
    assert want == ((100, 160) if form in _TURNED else (160, 100))
    src, out = _one(tmp_path, f"x.{'png' if kind == 'png' else 'jpg'}", data)
    assert _counts(build(src, out, workers=1, progress=False)) == (2, 2, 0, 0)
    record = Store(out).record(0)
    assert (record["width"], record["height"]) == want


def test_the_first_of_two_exif_blocks_decides_as_in_pil(tmp_path: Path):
    buf = io.BytesIO()
    _photo((160, 100)).save(buf, "JPEG", quality=90)
    jpeg, blocks = buf.getvalue(), b""
    for orientation in (6, 1):  # the build's parser let the last one win
        segment = b"Exif\x00\x00" + _exif(struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0))
        blocks += b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment
    both = jpeg[:2] + blocks + jpeg[2:]
    assert Image.open(io.BytesIO(both)).getexif()[0x0112] == 6
    assert parse_jpeg(both).orientation == 6
    src, out = _one(tmp_path, "two.jpg", both)
    build(src, out, workers=1, progress=False)
    record = Store(out).record(0)
    assert (record["width"], record["height"]) == (100, 160)


def _lossless_jpeg(components: int) -> bytes:
    """An 8x8 lossless JPEG (SOF3) of mid-gray: every difference from the predictor 0, one
    Huffman code of one bit for it."""

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body

    ids = range(1, components + 1)
    frame = bytes([8]) + struct.pack(">HHB", 8, 8, components)
    frame += b"".join(bytes([c, 0x11, 0]) for c in ids)
    table = bytes([0x00, 1] + [0] * 15 + [0])
    scan = bytes([components]) + b"".join(bytes([c, 0]) for c in ids) + bytes([1, 0, 0])
    data = bytes(8 * components)  # 64 pixels of one 0 bit per component
    return (
        b"\xff\xd8"
        + segment(0xC3, frame)
        + segment(0xC4, table)
        + segment(0xDA, scan)
        + (data + b"\xff\xd9")
    )


@pytest.mark.parametrize("components", [1, 3])
def test_a_lossless_jpeg_is_verified_and_converted(tmp_path: Path, components: int):
    # The check asked libjpeg-turbo for gray at 1/8 scale, which a lossless JPEG of colour
    # cannot give ("Unsupported color conversion request"): a valid file, called corrupt.
    data = _lossless_jpeg(components)
    extrema = Image.open(io.BytesIO(data)).getextrema()  # PIL reads it: mid-gray
    assert extrema == (((128, 128),) * 3 if components == 3 else (128, 128))
    src, out = _one(tmp_path, "lossless.jpg", data)
    assert _counts(build(src, out, workers=1, progress=False)) == (2, 2, 0, 0)
    record = Store(out).record(0)
    assert record["fixes"] == ["reencoded-jpeg:q95"]
    assert (record["height"], record["width"]) == (8, 8)
    image, _ = LMDBDataset(out)[0]
    assert np.abs(np.asarray(image).astype(int) - 128).max() <= 1  # q95 of a flat gray


def test_a_12_bit_jpeg_is_refused_as_unsupported_not_corrupt(tmp_path: Path):
    buf = io.BytesIO()
    _photo().save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 4] = 12  # the frame's sample precision
    src, out = _one(tmp_path, "twelve.jpg", bytes(data))
    assert _counts(build(src, out, workers=1, progress=False)) == (2, 1, 1, 0)
    assert json.loads((out / fmt.REJECTS).read_text())["reason"] == (
        "unsupported JPEG: 12-bit samples (the readers take 8-bit JPEGs; convert it to 8-bit)"
    )


def test_a_jpeg_of_many_scans_is_decoded_once_at_the_build(tmp_path: Path, monkeypatch):
    # Each scan of a progressive JPEG is another pass of its decode: 694 tiny scans cost 15
    # times a normal decode, in every epoch. Over KEPT_SCANS it is stored as baseline, over
    # MAX_SCANS refused (the thresholds lowered here to a PIL progressive JPEG's scans).
    buf = io.BytesIO()
    _photo((160, 100)).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    scans = walk_scans(data, parse_jpeg(data))[2]
    assert scans == data.count(b"\xff\xda") == 10  # libjpeg's script for colour images
    src, out = _one(tmp_path, "prog.jpg", data)
    monkeypatch.setattr(normalize, "KEPT_SCANS", 9)
    build(src, out, workers=1, progress=False)
    record = Store(out).record(0)
    assert record["fixes"] == ["reencoded-jpeg:q95"] and not parse_jpeg(record["image"]).progressive
    unverified = BuildOptions(verify=False)  # its scans counted all the same
    build(src, tmp_path / "unverified", unverified, workers=1, progress=False)
    assert Store(tmp_path / "unverified").record(0)["fixes"] == ["reencoded-jpeg:q95"]
    monkeypatch.setattr(normalize, "MAX_SCANS", 9)
    for out, options in ((tmp_path / "refused", None), (tmp_path / "refused2", unverified)):
        manifest = build(src, out, options, workers=1, progress=False)
        assert _counts(manifest) == (2, 1, 1, 0)
        assert json.loads((out / fmt.REJECTS).read_text())["reason"] == (
            "too many scans: 10 in one JPEG (over 9; each decode of it would cost seconds): "
            "re-encode it"
        )


# What a fuzz campaign of stores found (a store from elsewhere is untrusted input).


def _edited(store: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``store`` whose manifest ``edit`` changed."""
    copy = tmp_path / "edited"
    shutil.copytree(store, copy)
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    edit(manifest)
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzzed")
    build(_tree(root / "src"), root / "store", workers=1, progress=False)
    return root / "store"


def test_ingest_info_shows_a_stores_text_without_control_characters(small_store, tmp_path):
    def edit(m):
        m["stats"]["\x1b]0;title\x07\x1b[2J"] = 1
        m["ignored_by_reason"]["\x1b[31mred\x1b[0m"] = 1

    result = run_ingest("info", _edited(small_store, tmp_path, edit))
    assert result.returncode == 0 and "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "  \\x1b]0;title\\x07\\x1b[2J" in result.stdout
    assert "  ignored: \\x1b[31mred\\x1b[0m" in result.stdout
    # A value is a count, or the store is refused.
    edited = _edited(small_store, tmp_path / "v", lambda m: m["stats"].update(png="\x1b[31m"))
    result = run_ingest("info", edited)
    assert result.returncode == 2 and "'stats' holds a value that is not a count" in result.stderr


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda m: m.update(record_bytes=10**400), "'record_bytes' is not a count"),
        (lambda m: m["shards"][0].update(file_bytes=-1), "shard 0 lacks a valid 'file_bytes'"),
        (lambda m: m.update(num_samples=0), "'num_samples' is 0, where a build writes a store"),
    ],
    ids=["too-large", "negative", "no-sample"],
)
def test_a_manifest_count_no_build_writes_is_refused_at_open(small_store, tmp_path, edit, said):
    # 10**400 made `ingest info` die in an OverflowError; 0 samples made the loader raise a
    # ValueError about an argument the user never gave.
    store = _edited(small_store, tmp_path, edit)
    with pytest.raises(fmt.StoreError, match=re.escape(said)):
        loader.DataLoader(store, batch_size=2, transform="eval")
    result = run_ingest("info", store)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and said in result.stderr


def test_a_malformed_icc_marker_is_read_alike_whatever_num_workers(tmp_path: Path):
    # libjpeg-turbo's strict check (the main process's, before OpenCV) warned "bad ICC
    # marker" and replaced the sample; a worker's OpenCV decode never reads the marker.
    buf = io.BytesIO()
    _photo((96, 64)).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    bad = jpeg[:2] + b"\xff\xe2\x00\x10ICC_PROFILE\x00\x05\x01" + jpeg[2:]
    src, out = _one(tmp_path, "icc.jpg", bad)
    assert _counts(build(src, out, workers=1, progress=False)) == (2, 2, 0, 0)
    assert Store(out).record(0)["image"] == bad  # kept as it is: its pixels are whole
    got = []
    for workers in (0, 2):
        dl = loader.DataLoader(out, batch_size=2, num_workers=workers, transform="eval",
                               image_size=32, device="cpu", dtype=torch.uint8)  # fmt: skip
        got.append([images.clone() for images, _ in dl])
        assert dl.num_replaced == 0
    assert torch.equal(got[0][0], got[1][0])
    assert run_ingest("verify", out).returncode == 0


def test_a_branch_page_that_misroutes_lookups_fails_verify(tmp_path: Path):
    # One separator key of the shard's root page raised, in place: the pages still lead
    # nowhere outside the file and a walk of the leaves finds every record, but a lookup
    # of the keys below the new separator goes to the wrong leaf. `ingest verify` walked
    # (OK) where readers look up (replaced, "check the store with `ingest verify`").
    src = tmp_path / "src"
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(40):  # tiny records, a few a leaf page: the root is a branch page
            Image.effect_noise((20, 23), 40 + i).convert("RGB").save(src / f"c{c}/{i:03d}.jpg")
    out = tmp_path / "store"
    build(src, out, workers=1, progress=False)
    path = out / "shard-00000" / "data.mdb"
    pages, size = bytearray(path.read_bytes()), 4096
    metas = [struct.unpack_from("<QQ", pages, k * size + 136) for k in range(2)]  # last, txn
    newer = 0 if metas[0][1] > metas[1][1] else 1
    root = struct.unpack_from("<Q", pages, newer * size + 128)[0]  # the main tree's root
    at = root * size
    flags, lower = struct.unpack_from("<HH", pages, at + 10)
    assert flags & 1  # a branch page
    nodes = [struct.unpack_from("<H", pages, at + 16 + 2 * k)[0] for k in range((lower - 16) // 2)]
    first, second = (struct.unpack_from(">Q", pages, at + n + 8)[0] for n in nodes[1:3])
    struct.pack_into(">Q", pages, at + nodes[1] + 8, second - 1)  # still in order
    path.write_bytes(bytes(pages))  # the same size
    missed = list(range(first, second - 1))
    result = run_ingest("verify", out)
    assert result.returncode == 1
    for key in missed:
        assert (
            f"shard-00000: key {key}: not found by a lookup, where a walk of the shard finds it "
            "(damaged LMDB branch pages); rebuild the store"
        ) in result.stderr
    # seed 0: no replacement draws one of the other missed keys (which counts again)
    dl = loader.DataLoader(out, batch_size=8, transform="eval", image_size=16, device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 120
    assert sorted(dl.bad_samples) == missed and dl.num_replaced == len(missed)


def test_a_shard_of_another_build_with_the_manifest_unchanged_is_not_called_rebuilt(
    small_store, tmp_path
):
    # "The store was rebuilt since it was opened; open the store again" was said where
    # nothing was rebuilt (LMDB reading damaged pages as an older state, a mixed store),
    # and opening again gave the same.
    store = _edited(small_store, tmp_path, lambda m: m.update(build="0" * 32))
    said = (
        "written by another build than the store's manifest (a mixed store, or damaged "
        "pages LMDB reads as an older state); rebuild the store"
    )
    with pytest.raises(fmt.StoreError, match=re.escape(said)):
        LMDBDataset(store)[0]
    with pytest.raises(fmt.StoreError, match=re.escape(said)):
        list(loader.DataLoader(store, batch_size=2, transform="eval", device="cpu"))


def test_an_index_of_another_shape_is_named_so(small_store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(small_store, copy)
    index = np.load(copy / fmt.INDEX)
    np.save(copy / fmt.INDEX, index.reshape(2, -1))
    with pytest.raises(fmt.StoreError) as e:
        Store(copy)
    assert str(e.value) == (
        f"{copy / fmt.INDEX}: an array of shape (2, 3), where the index is one row a sample; "
        "the store is damaged or was edited: rebuild it"
    )
