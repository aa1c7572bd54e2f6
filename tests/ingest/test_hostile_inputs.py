"""Hostile inputs of the converter: nothing hangs, nothing crashes, nothing lies.

Source trees with one hostile entry each (FIFOs, sockets, devices, broken and looping
links, undecodable names, links back into the tree, corrupt JPEGs, decompression bombs, a
full disk), bytes no decoder reads, the image header probes, and `ingest verify` and
`ingest info` on stores tampered with on disk (the readers' side of those:
tests/loader/test_tampered_stores.py). Every test runs under an alarm: a hang fails it
instead of the suite.
"""

from __future__ import annotations

import gc
import io
import json
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import zlib
from pathlib import Path

import cv2
import lmdb
import numpy as np
import pytest
import zstandard
from fixtures import assert_same_store, run_ingest
from hostile_data import (
    HANG_S,
    KiB,
    claiming,
    damage_last_leaf_page,
    fails_if_hung,
    png_chunks,
    png_of,
    rewrite_record,
    small_jpeg,
    small_store,
    tree,
)
from PIL import Image

import ingest.build.run as ingest_build
import ingest.build.writer as ingest_writer
import loader
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.build.resume import OutputError
from ingest.format.codec import decompress, encoded_limit
from ingest.images.probe import PngError, image_size, parse_jpeg, plain_png
from ingest.verify import verify_store
from loader import LMDBDataset
from loader.bench.synth import make_image_folder
from loader.store import Store


def rejects(out: Path) -> dict[str, str]:
    lines = (out / fmt.REJECTS).read_text(encoding="utf-8").splitlines()
    return {r["path"]: r["reason"] for r in map(json.loads, lines)}


def counts(manifest: dict) -> tuple[int, int, int, int]:
    return (manifest["num_seen"], manifest["num_samples"], manifest["num_rejected"],
            manifest["num_ignored"])  # fmt: skip


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


# -- the build finishes, with every entry accounted for ----------------------------------


def test_fifo_socket_and_device_are_rejected_not_read(tmp_path: Path):
    src = tree(tmp_path / "src")
    os.mkfifo(src / "class_00" / "fifo.jpg")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "class_00" / "sock.jpg"))
    os.symlink("/dev/zero", src / "class_01" / "zero.jpg")
    manifest = build(src, tmp_path / "out", workers=2, progress=False)
    sock.close()
    assert counts(manifest) == (9, 6, 3, 0)
    assert rejects(tmp_path / "out") == {
        "class_00/fifo.jpg": "not a regular file: a FIFO (named pipe)",
        "class_00/sock.jpg": "not a regular file: a socket",
        "class_01/zero.jpg": "not a regular file: a character device",
    }


def test_a_file_over_the_size_limit_is_rejected_unread(tmp_path: Path):
    src = tree(tmp_path / "src")
    (src / "class_01" / "huge.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100 * KiB))
    options = BuildOptions(max_file_bytes=64 * KiB)
    manifest = build(src, tmp_path / "out", options, workers=1, progress=False)
    assert counts(manifest) == (7, 6, 1, 0)
    assert rejects(tmp_path / "out") == {
        "class_01/huge.jpg": "too large: 102403 bytes, over the limit of 65536 bytes "
        "(--max-file-size)"
    }


def test_broken_links_loops_and_vanished_files_are_rejects(tmp_path, monkeypatch):
    src = tree(tmp_path / "src")
    os.symlink("missing.jpg", src / "class_00" / "dangling.jpg")
    os.symlink("loop_b.jpg", src / "class_00" / "loop_a.jpg")
    os.symlink("loop_a.jpg", src / "class_00" / "loop_b.jpg")
    real_scan = ingest_build.scan

    def scan_then_delete(root):  # the file goes between the scan and the fingerprint
        result = real_scan(root)
        (src / "class_01" / "img_00001.JPEG").unlink()
        return result

    monkeypatch.setattr(ingest_build, "scan", scan_then_delete)
    manifest = build(src, tmp_path / "out", workers=1, progress=False)
    assert counts(manifest) == (9, 5, 4, 0)
    assert rejects(tmp_path / "out") == {
        "class_00/dangling.jpg": "unreadable: a broken symbolic link (its target does not exist)",
        "class_00/loop_a.jpg": "unreadable: a symbolic link loop",
        "class_00/loop_b.jpg": "unreadable: a symbolic link loop",
        "class_01/img_00001.JPEG": "unreadable: the file vanished during the build",
    }


def test_names_that_are_not_utf8_are_kept_losslessly(tmp_path: Path):
    src = tree(tmp_path / "src")
    raw = os.fsencode(src)
    jpeg = (src / "class_01" / "img_00000.JPEG").read_bytes()
    os.mkdir(raw + b"/cl\xffass")
    for name in (b"/class_01/caf\xe9.jpg", b"/cl\xffass/x.jpg"):
        with open(raw + name, "wb") as f:
            f.write(jpeg)
    manifest = build(src, tmp_path / "out", workers=2, progress=False)
    assert counts(manifest) == (8, 8, 0, 0)
    assert manifest["classes"] == ["class_00", "class_01", os.fsdecode(b"cl\xffass")]
    assert verify_store(tmp_path / "out") == []  # before a reader opens it in this process
    ds = LMDBDataset(tmp_path / "out")
    assert ds.samples[3] == (os.fsdecode(b"class_01/caf\xe9.jpg"), 1)
    assert ds.samples[7] == (os.fsdecode(b"cl\xffass/x.jpg"), 2)
    assert ds.store.record(3)["path"] == b"class_01/caf\xe9.jpg"  # the name's own bytes
    assert os.path.exists(src / ds.samples[3][0])  # the path finds the file again
    assert fmt.shown(ds.samples[3][0]) == "class_01/caf\\xe9.jpg"


def test_a_link_back_into_the_tree_is_walked_once(tmp_path: Path, caplog):
    src = tree(tmp_path / "src")
    os.symlink("..", src / "class_00" / "up")
    os.symlink("../class_00", src / "class_01" / "sibling")
    manifest = build(src, tmp_path / "out", workers=1, progress=False)
    assert counts(manifest) == (6, 6, 0, 0)
    assert manifest["skipped"] == [
        {"path": "class_00/up", "reason": "a link to a folder walked already (the source folder)"},
        {"path": "class_01/sibling", "reason": "a link to a folder walked already (class_00)"},
    ]
    assert "ingest: skipped class_00/up: a link to a folder walked already" in caplog.text


def test_out_inside_src_is_refused_and_a_store_in_src_is_no_class(tmp_path: Path):
    src = tree(tmp_path / "src")
    result = run_ingest("build", src, src / "train.lmdb", "--workers", "1")
    assert result.returncode == 2
    assert result.stderr == (
        f"ingest build: error: output {src / 'train.lmdb'} is inside the source folder "
        f"{src}; put the store outside it (e.g. next to it)\n"
    )
    assert not (src / "train.lmdb").exists()
    build(src, tmp_path / "first", workers=1, progress=False)
    shutil.copytree(tmp_path / "first", src / "old.lmdb")  # a store someone left in SRC
    manifest = build(src, tmp_path / "second", workers=1, progress=False)
    assert manifest["classes"] == ["class_00", "class_01"]
    assert manifest["skipped"] == [
        {"path": "old.lmdb", "reason": "a store (ingest build output), not a class"}
    ]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(mount, capture_output=True, check=False).returncode == 0


def test_a_full_disk_is_one_line_and_the_rerun_resumes_to_the_same_store(tmp_path: Path):
    src = tmp_path / "src"
    make_image_folder(src, 2, 12, short_side=(160, 200))
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "400k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        args = ("--workers", "1", "--shard-size", "64KiB")
        full = run_ingest("build", src, disk / "out", *args)
        assert full.returncode == 2
        assert full.stderr.startswith(
            f"ingest build: error: output {disk / 'out'}: its filesystem is full"
        )
        assert full.stderr.endswith(
            "free some space and run the same command again: it resumes from the last "
            "completed shard\n"
        )
        assert full.stderr.count("\n") == 1  # one line, no traceback
        assert not (disk / "out" / fmt.MANIFEST).exists()
        sealed = json.loads((disk / "out" / fmt.BUILD_STATE).read_text())["shards"]
        assert sealed  # some shards were done before the disk filled up
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = run_ingest("build", src, disk / "out", *args)
        assert resumed.returncode == 0, resumed.stderr
        clean = run_ingest("build", src, tmp_path / "clean", *args)
        assert clean.returncode == 0, clean.stderr
        assert_same_store(disk / "out", tmp_path / "clean")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_failing_commit_is_one_error_and_the_rerun_gives_the_clean_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The same path without a small filesystem: the writer's commit fails as LMDB fails on
    a full disk (an I/O error) once two shards are sealed; the disk itself has room."""
    src = tmp_path / "src"
    make_image_folder(src, 2, 6, short_side=(160, 200))
    options = BuildOptions(shard_size=64 * KiB)
    commit, calls = ingest_writer.ShardWriter._commit, []

    def failing(self):
        calls.append(self.tmp_dir.name)
        if len(set(calls)) == 3:
            raise lmdb.Error("mdb_txn_commit: Input/output error")
        commit(self)

    monkeypatch.setattr(ingest_writer.ShardWriter, "_commit", failing)
    message = (
        f"output {tmp_path / 'out'}: writing failed (mdb_txn_commit: Input/output error); "
        "check the disk, then run the same command again: it resumes from the last "
        "completed shard"
    )
    with pytest.raises(OutputError, match=f"^{re.escape(message)}$"):
        build(src, tmp_path / "out", options, workers=1, progress=False)
    gc.collect()  # the failed build's LMDB environment closes with its last reference
    assert not (tmp_path / "out" / fmt.MANIFEST).exists()
    assert len(json.loads((tmp_path / "out" / fmt.BUILD_STATE).read_text())["shards"]) == 2
    monkeypatch.undo()
    build(src, tmp_path / "out", options, workers=1, progress=False)
    build(src, tmp_path / "clean", options, workers=1, progress=False)
    assert_same_store(tmp_path / "out", tmp_path / "clean")


def test_no_valid_image_leaves_no_store_and_the_rerun_is_not_refused(tmp_path: Path):
    src = tmp_path / "src"
    for name in ("class_00", "class_01"):
        (src / name).mkdir(parents=True)
        (src / name / "bad.jpg").write_bytes(b"<html>404</html>")
    message = (
        f"ingest build: error: no valid image in {src}: 2 file(s) rejected (reasons in "
        f"{tmp_path / 'out' / fmt.REJECTS}), 0 ignored; no store was written\n"
    )
    for _ in range(2):  # the second run is not refused as "already a complete store"
        result = run_ingest("build", src, tmp_path / "out", "--workers", "1")
        assert (result.returncode, result.stderr) == (2, message)
        assert not (tmp_path / "out" / fmt.MANIFEST).exists()
        assert not (tmp_path / "out" / fmt.PARTIAL_DIR).exists()  # nothing to resume from
    assert set(rejects(tmp_path / "out")) == {"class_00/bad.jpg", "class_01/bad.jpg"}
    info = run_ingest("info", tmp_path / "out")  # not "an interrupted build: ... resume"
    assert (info.returncode, info.stderr) == (2, (
        f"ingest info: error: {tmp_path / 'out'}: not a complete store, manifest.json is "
        f"missing (its last build found no valid image: the reasons are in "
        f"{tmp_path / 'out' / fmt.REJECTS}; mend the source and build again)\n"))  # fmt: skip
    (src / "class_00" / "good.jpg").write_bytes(small_jpeg())  # the source mended
    result = run_ingest("build", src, tmp_path / "out", "--workers", "1")
    assert (result.returncode, result.stderr) == (0, "")  # it said "holds an interrupted build"
    assert "seen 3 = kept 1 + rejected 2 + ignored 0" in result.stdout


# -- verification catches what training would choke on -----------------------------------


def _zeroed_data(jpeg: bytes) -> bytes:
    """``jpeg`` with 350 bytes of its entropy-coded data zeroed (no marker in them)."""
    scan = parse_jpeg(jpeg).scan
    start = scan + 2 + int.from_bytes(jpeg[scan + 2 : scan + 4], "big")
    return jpeg[: start + 50] + bytes(350) + jpeg[start + 400 :]


def test_jpegs_that_only_make_libjpeg_warn_are_rejected_silently(tmp_path: Path):
    src = tree(tmp_path / "src")
    jpeg = small_jpeg()
    (src / "class_00" / "claims.jpg").write_bytes(claiming(jpeg, 2000, 2000))
    (src / "class_01" / "zeroed.jpg").write_bytes(_zeroed_data(jpeg))
    result = run_ingest("build", src, tmp_path / "out", "--workers", "2")
    assert result.returncode == 0
    assert "Corrupt JPEG" not in result.stderr  # nothing from libjpeg on the terminal
    assert rejects(tmp_path / "out") == {
        "class_00/claims.jpg": "corrupt JPEG data: the decoder warns: premature end of data "
        "segment",
        "class_01/zeroed.jpg": "corrupt JPEG data: the decoder warns: 889 extraneous bytes "
        "before marker 0xd9",
    }


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decompression_bombs_are_rejected_from_their_header(tmp_path: Path):
    src = tree(tmp_path / "src")
    (src / "class_00" / "bomb20k.png").write_bytes(_png_claiming(20000, 20000))
    (src / "class_01" / "bomb900m.png").write_bytes(_png_claiming(30000, 30000))
    (src / "class_01" / "bomb.jpg").write_bytes(claiming(small_jpeg(), 20000, 20000))
    manifest = build(src, tmp_path / "out", workers=1, progress=False)
    assert counts(manifest) == (9, 6, 3, 0)
    limit = "is over the limit of 178956970 (--max-pixels; a decompression bomb?)"
    assert rejects(tmp_path / "out") == {
        "class_00/bomb20k.png": f"too many pixels: 20000x20000 {limit}",
        "class_01/bomb.jpg": f"too many pixels: 20000x20000 {limit}",
        "class_01/bomb900m.png": f"too many pixels: 30000x30000 {limit}",
    }
    assert manifest["options"]["max_pixels"] == 178956970


# -- bytes no decoder reads are not stored; a PNG is stored only as readers read it --------


def _only_png(tmp_path: Path, name: str, data: bytes) -> tuple[Path, Path]:
    """A tree of one class holding one photo-derived PNG, replaced by ``data``."""
    src = tree(tmp_path / "src", 1, 1)
    jpeg = next((src / "class_00").iterdir())
    pixels = cv2.imdecode(np.frombuffer(jpeg.read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    jpeg.unlink()
    (src / "class_00" / name).write_bytes(data(pixels))
    return src, tmp_path / "out"


def _progressive_with_a_comment_between_scans(jpeg: bytes, comment: bytes) -> bytes:
    """``jpeg`` saved progressive by PIL, ``comment`` (a COM segment) put between its first
    and second scans."""
    rgb = cv2.cvtColor(cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR),
                       cv2.COLOR_BGR2RGB)  # fmt: skip
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, progressive=True)
    data = buf.getvalue()
    first = parse_jpeg(data).scan
    after_header = first + 2 + int.from_bytes(data[first + 2 : first + 4], "big")
    second = re.compile(rb"\xff(?![\x00\xd0-\xd7\xff])").search(data, after_header).start()
    assert data[second + 1] in (0xC4, 0xDA)  # the next scan's tables or header
    segment = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
    return data[:second] + segment + data[second:]


def test_bytes_after_a_jpegs_end_are_dropped_and_its_pixels_kept(tmp_path: Path):
    """A motion photo's video, a second picture, padding: after the end-of-image marker
    no decoder reads them, and every epoch would carry them. An end-of-image marker inside
    a marker segment (a comment between two scans, an EXIF thumbnail) is not the image's
    end: cut there, a progressive JPEG lost its later scans."""
    src = tree(tmp_path / "src", 1, 2)
    path = sorted((src / "class_00").iterdir())[0]
    marked = _progressive_with_a_comment_between_scans(path.read_bytes(), b"\xff\xd9\0\0")
    assert parse_jpeg(marked).progressive
    trailer = b"\x00\x00\x00\x18ftypmp42" + bytes(1 << 20)
    path.write_bytes(marked + trailer)
    for workers in (1, 2):
        manifest = build(src, tmp_path / f"out{workers}", workers=workers, progress=False)
        assert counts(manifest) == (2, 2, 0, 0)
    assert_same_store(tmp_path / "out1", tmp_path / "out2")
    out = tmp_path / "out1"
    record = Store(out).record(0)
    assert record["path"] == f"class_00/{path.name}"
    assert record["image"] == marked
    assert record["fixes"] == [f"trailing-bytes-dropped:{len(trailer)}"]
    assert Store(out).record(1)["fixes"] == []  # the other photo, byte for byte
    assert manifest["stats"]["fix trailing-bytes-dropped"] == 1
    assert "re-encoded" not in manifest["stats"]  # cut, not re-encoded: read once
    assert verify_store(out) == []
    expected = cv2.imdecode(np.frombuffer(marked, np.uint8), cv2.IMREAD_COLOR)
    stored = cv2.imdecode(np.frombuffer(record["image"], np.uint8), cv2.IMREAD_COLOR)
    np.testing.assert_array_equal(stored, expected)


def test_an_unverified_build_finds_a_jpegs_end_only_where_the_file_does_not_end_there(
    tmp_path: Path,
):
    """Finding the end means walking the scans, which a verified build does anyway and
    which cost an unverified one a sixth of its speed: that one walks only a file that
    does not end with an end-of-image marker (padding, a video), and keeps one that does
    (a second picture appended) whole."""
    src = tree(tmp_path / "src", 1, 2)
    padded, second = sorted((src / "class_00").iterdir())
    jpegs = padded.read_bytes(), second.read_bytes()
    padded.write_bytes(jpegs[0] + bytes(1000))
    second.write_bytes(jpegs[1] + jpegs[0])  # ends with the other picture's end marker
    for verify, kept in ((True, jpegs[1]), (False, jpegs[1] + jpegs[0])):
        out = tmp_path / f"out-{verify}"
        build(src, out, BuildOptions(verify=verify), workers=2, progress=False)
        assert Store(out).record(0)["image"] == jpegs[0]
        assert Store(out).record(0)["fixes"] == ["trailing-bytes-dropped:1000"]
        assert Store(out).record(1)["image"] == kept
        assert verify_store(out) == []


def test_a_png_with_bytes_after_its_end_is_stored_without_them_and_reads_clean(tmp_path):
    """PIL reads a PNG with bytes after its end chunk; the readers' check refuses it. The
    build kept it whole, so a fresh store failed `ingest verify` and its sample was
    replaced in training. It is now stored up to its end chunk."""
    png = {}

    def padded(pixels):
        png["bytes"] = cv2.imencode(".png", pixels)[1].tobytes()
        return png["bytes"] + b"\0\0\0\0"

    src, out = _only_png(tmp_path, "pad.png", padded)
    assert counts(build(src, out, workers=1, progress=False)) == (1, 1, 0, 0)
    record = Store(out).record(0)
    assert record["image"] == png["bytes"] and record["format"] == "png"
    assert record["fixes"] == ["trailing-bytes-dropped:4"]
    assert verify_store(out) == []
    dl = loader.DataLoader(out, batch_size=1, transform="eval", device="cpu", seed=0)
    assert sum(len(labels) for _, labels in dl) == 1 and not dl.bad_samples


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_png_with_exif_is_read_by_pil_and_turned_as_it_says(tmp_path: Path, orientation):
    """PNGs without EXIF data are kept without PIL reading them; one with an eXIf chunk is
    PIL's to read: turned where its orientation says so, kept as it is where it says 1."""
    exif = b"II*\0\x08\0\0\0\x01\0\x12\x01\x03\0\x01\0\0\0" + bytes([orientation, 0, 0, 0])
    exif += b"\0\0\0\0"  # no next IFD
    png = {}

    def with_exif(pixels):
        chunks = png_chunks(cv2.imencode(".png", pixels)[1].tobytes())
        png["bytes"] = png_of([chunks[0], (b"eXIf", exif), *chunks[1:]])
        png["shape"] = pixels.shape[:2]
        return png["bytes"]

    src, out = _only_png(tmp_path, "exif.png", with_exif)
    assert counts(build(src, out, workers=1, progress=False)) == (1, 1, 0, 0)
    record = Store(out).record(0)
    height, width = png["shape"]
    if orientation == 1:  # its critical chunks as they are; the eXIf chunk dropped
        chunks = png_chunks(png["bytes"])
        assert record["image"] == png_of([c for c in chunks if c[0] != b"eXIf"])
        assert record["fixes"] == [f"png-ancillary-chunks-dropped:{12 + len(exif)}"]
        assert (record["height"], record["width"]) == (height, width)
    else:
        assert record["fixes"] == ["exif-orientation:6", "reencoded-png"]
        assert (record["height"], record["width"]) == (width, height)
    assert verify_store(out) == []


def test_a_png_pil_reads_and_the_readers_refuse_is_converted_losslessly(tmp_path: Path):
    """Bytes after the image data's zlib stream inside IDAT: PIL decodes the image, the
    readers' check (``plain_png``) refuses it. Stored as a PNG encoded again, the same
    pixels, so that no reader meets it as a bad sample."""
    pixels_of = {}

    def junk_in_idat(pixels):
        pixels_of["rgb"] = pixels
        chunks = png_chunks(cv2.imencode(".png", pixels)[1].tobytes())
        return png_of(
            [(kind, body + b"junk" if kind == b"IDAT" else body) for kind, body in chunks]
        )

    src, out = _only_png(tmp_path, "junk.png", junk_in_idat)
    with pytest.raises(PngError, match=r"is not the \d+ bytes the header needs"):
        plain_png(next((src / "class_00").iterdir()).read_bytes())
    assert counts(build(src, out, workers=1, progress=False)) == (1, 1, 0, 0)
    record = Store(out).record(0)
    assert record["fixes"] == ["reencoded-png"] and record["format"] == "png"
    assert plain_png(record["image"])  # passes the readers' check
    stored = cv2.imdecode(np.frombuffer(record["image"], np.uint8), cv2.IMREAD_COLOR)
    np.testing.assert_array_equal(stored, pixels_of["rgb"])
    assert verify_store(out) == []


# -- a store read from disk is untrusted input ---------------------------------------------


def test_a_shard_directory_linked_outside_the_store_is_refused(copy: Path, tmp_path: Path):
    shutil.move(copy / "shard-00002", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", copy / "shard-00002")
    target = tmp_path / "elsewhere" / "data.mdb"
    assert verify_store(copy) == [
        f"shard-00002/data.mdb: leads outside the store (to {target}); rebuild the store"
    ]


def test_info_and_verify_do_not_hang_on_a_fifo_for_rejects(copy: Path):
    (copy / fmt.REJECTS).unlink()
    os.mkfifo(copy / fmt.REJECTS)
    for given in (copy, f"{copy}/", f"{copy.parent}/./{copy.name}"):  # told once each way
        info = run_ingest("info", given, timeout=30)
        assert info.stderr.count("\n") == 1, info.stderr
    assert (info.returncode, info.stderr) == (  # the summary is the manifest's
        1,
        f"ingest info: error: {copy / fmt.REJECTS}: a FIFO (named pipe), not a regular file; "
        "rebuild the store\n",
    )
    assert verify_store(copy) == [
        f"{fmt.REJECTS}: a FIFO (named pipe), not a regular file; rebuild the store"
    ]


def test_a_manifest_that_is_not_json_is_one_line_from_info_and_verify(copy: Path):
    (copy / fmt.MANIFEST).write_text('{"format": "imfeed-lmdb", "version": 2, ')
    for command in ("info", "verify"):
        result = run_ingest(command, copy)
        assert result.returncode == 2
        assert result.stderr.startswith(
            f"ingest {command}: error: {copy / fmt.MANIFEST}: not valid JSON ("
        )
        assert result.stderr.count("\n") == 1


def test_a_path_is_shown_without_its_control_characters():
    assert fmt.shown("a\x1b[2J\nb\x9bc.jpg") == "a\\x1b[2J\\x0ab\\x9bc.jpg"
    assert fmt.shown(b"caf\xe9.jpg") == "caf\\xe9.jpg"  # not UTF-8


def test_verify_refuses_unread_what_a_reader_refuses_over_the_pixel_limit(copy: Path):
    """Verify applies the store's pixel limit as the readers do, before decoding."""
    index = Store(copy).index
    pixels = [int(index[k]["height"]) * int(index[k]["width"]) for k in range(12)]
    limit = sorted(pixels)[6]  # half the records over it
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    manifest["options"]["max_pixels"] = limit
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    over = [k for k in range(12) if pixels[k] > limit]
    assert 0 < len(over) < 12
    problems = verify_store(copy)
    assert len(problems) == len(over)
    for k, problem in zip(over, problems, strict=True):
        assert f"key {k}: " in problem and f"is over the pixel limit of {limit}" in problem
        with pytest.raises(fmt.RecordError, match=f"over the pixel limit of {limit}"):
            Store(copy).image(k)


def test_a_file_larger_than_its_image_can_need_is_rejected(tmp_path: Path):
    """68 MB of APP15 segments in a 48x72 JPEG (each a legal 64 KB): no reader would read
    its record, so the build does not store it."""
    src = tree(tmp_path / "src", 1, 2)
    path = sorted((src / "class_00").iterdir())[0]
    jpeg = path.read_bytes()
    segment = b"\xff\xef\xff\xff" + bytes(0xFFFD)
    path.write_bytes(jpeg[:2] + segment * 1100 + jpeg[2:])
    manifest = build(src, tmp_path / "out", workers=1, progress=False)
    assert counts(manifest) == (2, 1, 1, 0)
    reason = rejects(tmp_path / "out")[f"class_00/{path.name}"]
    assert re.fullmatch(r"too many bytes for its pixels: \d+ bytes for \d+x\d+ pixels \(at "
                        r"most \d+\)", reason), reason  # fmt: skip


def test_verify_reports_an_empty_png_payload(copy: Path):
    row = Store(copy).index[3]
    rewrite_record(copy, 3, lambda record: record.update(image=b"", format="png"))
    assert verify_store(copy) == [  # refused, as by the loader, before a decoder sees it
        f"shard-00000: key 3: the PNG header gives no readable size, the index "
        f"{row['width']}x{row['height']}",
        "shard-00000: content checksum mismatch (records changed since the build)",
    ]


def test_a_zstd_frame_that_says_more_than_its_image_needs_is_refused_unread():
    """A few KiB of zstd can say gigabytes: the frame's content size is checked against
    what an image of its pixels needs before anything is allocated."""
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (200 << 20))
    limit = encoded_limit(32, 32)
    assert len(bomb) < 10_000 and limit == 8 * 32 * 32 + (64 << 20)
    with pytest.raises(ValueError, match=r"the frame says 209715200 bytes, over the"):
        decompress(bomb, "zstd", limit)
    small = zstandard.ZstdCompressor().compress(b"x" * 1000)
    assert decompress(small, "zstd", limit) == b"x" * 1000


def test_image_size_reads_jpeg_and_png_headers_only():
    pixels = np.zeros((37, 53, 3), np.uint8)
    jpeg, png = (cv2.imencode(ext, pixels)[1].tobytes() for ext in (".jpg", ".png"))
    assert image_size(jpeg, "jpeg") == image_size(png, "png") == (37, 53)
    assert image_size(jpeg[:300], "jpeg") == (37, 53)  # the header is all it reads
    assert image_size(png[:24], "png") == (37, 53)
    for data, kind in ((jpeg, "png"), (png, "jpeg"), (jpeg[:12], "jpeg"), (b"", "jpeg")):
        assert image_size(data, kind) is None


@pytest.mark.parametrize("interlace", [0, 1])
@pytest.mark.parametrize(
    "width, height, depth, colour",
    [(13, 7, 8, 2), (1, 1, 8, 0), (5, 3, 16, 6), (9, 17, 1, 0), (33, 2, 4, 3), (2, 9, 8, 4)],
)
def test_plain_png_takes_what_libpng_decodes_silently(capfd, width, height, depth, colour,
                                                      interlace):  # fmt: skip
    """Every depth and colour type, interlaced (Adam7) or not: the sizes ``plain_png``
    computes are libpng's; a row's filter type over 4 is refused."""
    bits = depth * {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    adam7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
             (0, 1, 1, 2)]  # fmt: skip  # (x, y, dx, dy) of each pass, as the PNG standard says
    rng, rows = np.random.default_rng(0), []
    for x, y, dx, dy in adam7 if interlace else [(0, 0, 1, 1)]:
        if width > x and height > y:  # a pass with no pixels has no rows
            size = math.ceil(math.ceil((width - x) / dx) * bits / 8)
            rows += [bytes([k % 5]) + rng.bytes(size) for k in range(math.ceil((height - y) / dy))]
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    palette = [(b"PLTE", bytes(range(48)))] if colour == 3 else []
    png = png_of([(b"IHDR", header), *palette, (b"IDAT", zlib.compress(b"".join(rows))),
                   (b"IEND", b"")])  # fmt: skip
    assert plain_png(png) == png
    decoded = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape == (height, width, 3) and capfd.readouterr().err == ""
    rows[-1] = b"\x05" + rows[-1][1:]
    with pytest.raises(PngError, match="unknown filter type"):
        plain_png(png_of([(b"IHDR", header), *palette,
                           (b"IDAT", zlib.compress(b"".join(rows))), (b"IEND", b"")]))  # fmt: skip


def test_verify_survives_a_damage_the_page_check_misses(copy: Path, monkeypatch):
    """Should a damage get past the page check, verify still reads each shard in a process
    of its own and reports the death as that shard's problem; the other shards are
    checked, and nothing from LMDB reaches the terminal."""
    import ingest.verify

    monkeypatch.setattr(ingest.verify, "pages_problem", lambda path: None)
    damage_last_leaf_page(copy / "shard-00001")
    problems = verify_store(copy)
    assert len(problems) == 1
    assert problems[0].startswith("shard-00001: reading its LMDB pages killed the reader "
                                  "(signal SIGBUS")  # fmt: skip
    assert problems[0].endswith("the shard is damaged; rebuild the store")
