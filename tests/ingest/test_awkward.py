"""The converter on every awkward, invalid and ignored kind of file (fixtures.make_awkward_tree).

Tolerances (mean absolute difference per channel value from the reference, which is PIL's
``ImageOps.exif_transpose(Image.open(p)).convert("RGB")``, or value / 257 for 16-bit gray):
exact for payloads stored byte for byte and for lossless PNG conversions, < 3 for JPEG
re-encodes (quality 95, 4:2:0), and < 1 between OpenCV and PIL on the same JPEG bytes.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from fixtures import (
    DECODER_TOL,
    Tree,
    count_files,
    decode_cv2,
    decode_pil,
    mean_abs_diff,
    read_shards,
    reference_rgb,
)

from ingest import format as fmt
from ingest.format.codec import RECORD_KEYS, image_bytes, unpack_record
from ingest.images.probe import parse_jpeg


@pytest.fixture(scope="module")
def manifest(awkward_store: Path) -> dict:
    return fmt.read_manifest(awkward_store)


@pytest.fixture(scope="module")
def records(awkward_store: Path) -> dict[str, dict]:
    """Every record of the store, by source path."""
    recs = [unpack_record(value) for _, _, value in read_shards(awkward_store)]
    return {rec["path"]: rec for rec in recs}


def test_counts_add_up(awkward_tree: Tree, manifest: dict) -> None:
    assert manifest["num_samples"] == len(awkward_tree.expect) == 26
    assert manifest["num_rejected"] == len(awkward_tree.invalid) == 6
    assert manifest["num_ignored"] == len(awkward_tree.ignored) == 5
    assert manifest["num_seen"] == count_files(awkward_tree.root) == 37
    assert manifest["num_seen"] == (
        manifest["num_samples"] + manifest["num_rejected"] + manifest["num_ignored"]
    )
    assert manifest["classes"] == ["class_00", "class_01"] and manifest["num_classes"] == 2
    assert len(manifest["shards"]) > 1


def test_invalid_files_are_rejected_with_reasons(awkward_tree: Tree, awkward_store: Path):
    lines = (awkward_store / fmt.REJECTS).read_text(encoding="utf-8").splitlines()
    rejects = {r["path"]: r["reason"] for r in map(json.loads, lines)}
    assert sorted(rejects) == sorted(awkward_tree.invalid)
    for path, reason in rejects.items():
        assert awkward_tree.invalid[path] in reason, (path, reason)


def test_ignored_files_are_not_stored(awkward_tree: Tree, awkward_store: Path, manifest: dict):
    paths = msgpack.unpackb((awkward_store / fmt.PATHS).read_bytes(), raw=False)
    assert sorted(paths) == sorted(awkward_tree.expect)
    assert not set(paths) & set(awkward_tree.ignored)
    reasons: dict[str, int] = {}
    for reason in awkward_tree.ignored.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    assert manifest["ignored_by_reason"] == reasons


def test_keys_index_and_record_layout(awkward_store: Path, manifest: dict) -> None:
    index = fmt.load_index(awkward_store, mmap=False)
    paths = msgpack.unpackb((awkward_store / fmt.PATHS).read_bytes(), raw=False)
    stored = read_shards(awkward_store)
    n = manifest["num_samples"]
    assert len(stored) == len(index) == len(paths) == n
    # Keys are the global sample index, 8 bytes big-endian, contiguous across shards.
    assert [key for _, key, _ in stored] == [i.to_bytes(8, "big") for i in range(n)]
    shard_of = []
    for number, entry in enumerate(manifest["shards"]):
        assert entry["name"] == f"shard-{number:05d}" and entry["first"] == len(shard_of)
        shard_of += [number] * entry["count"]
    assert [name for name, _, _ in stored] == [f"shard-{s:05d}" for s in shard_of]
    for i, (_, _, value) in enumerate(stored):
        assert list(msgpack.unpackb(value, raw=False)) == sorted(RECORD_KEYS)  # a map, sorted
        rec, row = unpack_record(value), index[i]
        assert rec["path"] == paths[i]
        assert rec["label"] == row["label"] == int(rec["path"].split("/")[0][-2:])
        assert (row["shard"], row["nbytes"], row["crc32"]) == (
            shard_of[i],
            len(value),
            zlib.crc32(value),
        )
        assert (row["height"], row["width"]) == (rec["height"], rec["width"])
        assert (row["channels"], fmt.FORMAT_NAMES[row["format"]]) == (
            rec["channels"],
            rec["format"],
        )
        assert bool(row["flags"] & fmt.FLAG_PROGRESSIVE) is rec["progressive"]
        assert bool(row["flags"] & fmt.FLAG_COMPRESSED) is False
        assert bool(row["flags"] & fmt.FLAG_REENCODED) is bool(rec["fixes"])
        assert row["subsampling"] == fmt.SUBSAMPLING_CODES.get(rec["subsampling"] or "", 0)


def source(tree: Tree, name: str) -> tuple[str, Path]:
    """The relative and full path of the stored file whose path below its class is ``name``."""
    rel = next(p for p in tree.expect if p.split("/", 1)[1] == name)
    return rel, tree.root / rel


def test_fixture_files_are_what_they_claim(awkward_tree: Tree) -> None:
    """Guards the fixture itself: the odd files really are odd."""

    def header(name: str):
        return parse_jpeg(source(awkward_tree, name)[1].read_bytes())

    assert (header("cmyk.jpg").components, header("cmyk.jpg").adobe_transform) == (4, 0)
    assert (header("ycck.jpg").components, header("ycck.jpg").adobe_transform) == (4, 2)
    assert header("gray.jpg").components == 1
    assert header("progressive.jpg").progressive
    assert [header(f"exif{o}.jpg").orientation for o in (3, 6, 8)] == [3, 6, 8]
    for name in ("rgb16.png", "gray16.png"):
        assert source(awkward_tree, name)[1].read_bytes()[24] == 16  # PNG bit depth
    png = source(awkward_tree, "png_named.JPEG")[1].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", [
    "cmyk.jpg", "ycck.jpg", "gray.jpg", "progressive.jpg", "exif3.jpg", "exif6.jpg",
    "exif8.jpg", "png_named.JPEG", "plain.png", "rgba.png", "la.png", "gray16.png",
    "rgb16.png", "palette.png", "palette_alpha.png", "image.webp", "image.bmp",
    "image.tiff", "image.gif", "sub/deeper/nested.jpg", "img_00002.JPEG",
])  # fmt: skip
def test_awkward_image_is_stored_right(awkward_tree: Tree, records: dict, name: str) -> None:
    rel, path = source(awkward_tree, name)
    expect, rec = awkward_tree.expect[rel], records[rel]
    assert tuple(rec["fixes"]) == expect.fixes
    assert (rec["format"], rec["source_format"]) == (expect.format, expect.source_format)
    assert (rec["channels"], rec["subsampling"]) == (expect.channels, expect.subsampling)
    assert rec["progressive"] is expect.progressive
    assert rec["compression"] is None
    payload = image_bytes(rec)
    assert (payload == path.read_bytes()) is expect.same_bytes
    if expect.format == "jpeg":
        assert parse_jpeg(payload).subsampling == expect.subsampling
    reference = reference_rgb(path, expect)
    assert reference.shape == (rec["height"], rec["width"], 3)
    with_pil, with_cv2 = decode_pil(payload), decode_cv2(payload)
    assert with_pil.shape == with_cv2.shape == reference.shape
    if expect.tolerance == 0:
        np.testing.assert_array_equal(with_pil, reference)
    else:
        assert mean_abs_diff(with_pil, reference) < expect.tolerance
    # OpenCV and PIL may round a JPEG's IDCT differently; PNG decodes agree exactly.
    cv2_tol = DECODER_TOL if expect.format == "jpeg" else 0
    assert mean_abs_diff(with_cv2, with_pil) <= cv2_tol
    assert mean_abs_diff(with_cv2, reference) <= expect.tolerance + cv2_tol


def test_exif_rotation_swaps_height_and_width(awkward_tree: Tree, records: dict) -> None:
    sizes = {}
    for rel, rec in records.items():
        name = Path(rel).stem
        if name.startswith("exif") or name == "progressive":
            sizes[name] = (rec["height"], rec["width"])
    h, w = sizes["progressive"]  # the same photo, upright
    assert sizes["exif3"] == (h, w)
    assert sizes["exif6"] == sizes["exif8"] == (w, h)
    assert h != w


def test_stats_count_the_fixes(manifest: dict) -> None:
    stats = manifest["stats"]
    assert stats["fix exif-orientation"] == 3
    assert stats["fix cmyk-to-rgb"] == 2
    assert stats["fix 16bit-to-8bit"] == 2
    assert stats["jpeg progressive"] == 1
    assert stats["re-encoded"] == 15
    assert stats["jpeg baseline"] + stats["jpeg progressive"] + stats["png"] == 26
