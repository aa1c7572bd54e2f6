"""Build options that change records: --compression and --max-size."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from fixtures import (
    EXACT,
    JPEG_REENCODE_TOL,
    Expect,
    decode_pil,
    mean_abs_diff,
    read_shards,
    reference_rgb,
    run_ingest,
)
from PIL import Image

from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.format.codec import Compression, image_bytes, parse_compression, unpack_record
from loader.store import Store

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def test_zstd_records_decode_to_the_same_images(tmp_path: Path, clean_tree, clean_store):
    out = tmp_path / "zstd"
    result = run_ingest(
        "build", clean_tree, out, "--compression", "zstd:3", "--shard-size", "32KiB",
        "--workers", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manifest = fmt.read_manifest(out)
    assert manifest["options"]["compression"] == "zstd:3"
    plain = [unpack_record(v) for _, _, v in read_shards(clean_store)]
    packed = [unpack_record(v) for _, _, v in read_shards(out)]
    assert len(packed) == len(plain) == 24
    index = fmt.load_index(out)
    for i, (a, b) in enumerate(zip(plain, packed, strict=True)):
        assert b["compression"] == "zstd" and a["compression"] is None
        assert b["image"].startswith(ZSTD_MAGIC)
        assert image_bytes(b) == a["image"]
        assert {k: v for k, v in a.items() if k not in ("image", "compression")} == {
            k: v for k, v in b.items() if k not in ("image", "compression")
        }
        assert index[i]["flags"] & fmt.FLAG_COMPRESSED
    store = Store(out)
    assert store.image(5) == (plain[5]["image"], plain[5]["format"])


@pytest.mark.parametrize(
    "spec, expected",
    [(None, Compression()), ("none", Compression()), ("zstd", Compression("zstd", 3)),
     ("zstd:1", Compression("zstd", 1)), ("zstd:22", Compression("zstd", 22))],
)  # fmt: skip
def test_parse_compression(spec, expected: Compression) -> None:
    assert parse_compression(spec) == expected
    assert parse_compression(str(expected)) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("lz4", r"--compression 'lz4': unknown compressor 'lz4'; use one of: none, zstd"),
        ("zstd:99", r"--compression 'zstd:99': level 99 is outside 1\.\.22"),
        ("zstd:0", r"level 0 is outside 1\.\.22"),
        ("zstd:fast", r"--compression 'zstd:fast': level must be an integer 1\.\.22"),
    ],
)
def test_parse_compression_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_compression(spec)


def test_max_size_resizes_only_larger_images(tmp_path: Path, clean_tree: Path) -> None:
    cap = 96
    build(clean_tree, tmp_path / "s", BuildOptions(max_size=cap), workers=1, progress=False)
    resized = kept = 0
    for _, _, value in read_shards(tmp_path / "s"):
        rec = unpack_record(value)
        source = clean_tree / rec["path"]
        with Image.open(source) as img:
            w, h = img.size
        if max(h, w) <= cap:
            kept += 1
            assert rec["image"] == source.read_bytes() and rec["fixes"] == []
            assert (rec["height"], rec["width"]) == (h, w)
            continue
        resized += 1
        assert max(rec["height"], rec["width"]) == cap
        assert (rec["height"] > rec["width"]) == (h > w)
        assert abs(rec["height"] / rec["width"] - h / w) < 2 / min(rec["height"], rec["width"])
        encoded = "reencoded-jpeg:q95" if rec["format"] == "jpeg" else "reencoded-png"
        assert rec["fixes"] == [f"resized-from:{w}x{h}", encoded]
        assert rec["format"] == rec["source_format"]
        # Reference: the source resized the same way (area averaging) from PIL's decode.
        reference = cv2.resize(
            reference_rgb(source, Expect((), "", "", 0)),
            (rec["width"], rec["height"]),
            interpolation=cv2.INTER_AREA,
        )
        got = decode_pil(rec["image"])
        tol = JPEG_REENCODE_TOL if rec["format"] == "jpeg" else EXACT
        if tol == EXACT:
            np.testing.assert_array_equal(got, reference)
        else:
            assert mean_abs_diff(got, reference) < tol
    assert resized >= 5 and kept >= 5 and resized + kept == 24
