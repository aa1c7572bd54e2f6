"""One file can never stop a build: surprises in a decoder and decompression bombs are rejects."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from ingest.build import build, process
from loader.bench.synth import make_image_folder


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG whose header claims ``width`` x ``height`` gray pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _rejects(out: Path) -> dict[str, str]:
    lines = (out / "rejects.jsonl").read_text().splitlines()
    return {r["path"]: r["reason"] for r in map(json.loads, lines)}


def test_a_decompression_bomb_is_rejected(tmp_path: Path):
    make_image_folder(tmp_path / "src", 1, 3)
    (tmp_path / "src" / "class_00" / "bomb.png").write_bytes(_png_claiming(40000, 40000))
    manifest = build(tmp_path / "src", tmp_path / "out", workers=1, progress=False)
    assert (manifest["num_samples"], manifest["num_rejected"]) == (3, 1)
    assert _rejects(tmp_path / "out")["class_00/bomb.png"] == (
        "too many pixels: 40000x40000 is over the limit of 178956970 (--max-pixels; "
        "a decompression bomb?)"
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_an_unexpected_error_on_one_file_rejects_only_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
):
    make_image_folder(tmp_path / "src", 2, 4)
    convert = process.convert

    def flaky(data: bytes, opts):
        if data == (tmp_path / "src" / "class_01" / "img_00002.JPEG").read_bytes():
            raise MemoryError("decoder ran out of memory")
        return convert(data, opts)

    monkeypatch.setattr(process, "convert", flaky)  # forked workers inherit it
    manifest = build(tmp_path / "src", tmp_path / "out", workers=workers, progress=False)
    assert (manifest["num_samples"], manifest["num_rejected"]) == (7, 1)
    reasons = _rejects(tmp_path / "out")
    assert reasons == {"class_01/img_00002.JPEG": "could not convert: MemoryError: "
                       "decoder ran out of memory"}  # fmt: skip
