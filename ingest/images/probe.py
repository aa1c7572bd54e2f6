"""Cheap header inspection: what a file is (magic bytes) and the size its header gives.

The JPEG and PNG probes themselves are ``jpeg.py`` and ``png.py``; the names readers use
are re-exported here.
"""

from __future__ import annotations

from ingest.images.jpeg import (
    JpegHeaderError,
    JpegInfo,
    jpeg_size,
    parse_jpeg,
    walk_scans,
    without_icc,
)
from ingest.images.png import PngError, plain_png, png_critical, png_end, png_has_exif, png_size

__all__ = [
    "JpegHeaderError",
    "JpegInfo",
    "PngError",
    "header_problem",
    "image_size",
    "parse_jpeg",
    "plain_png",
    "png_critical",
    "png_end",
    "png_has_exif",
    "sniff",
    "walk_scans",
    "without_icc",
]

# Formats the converter accepts as images, by magic bytes (never by file extension).
_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


def sniff(data: bytes) -> str:
    """Name the kind of ``data``: an image format, or a reason it is not an image.

    Returns one of "jpeg", "png", "gif", "bmp", "tiff", "webp", "pnm", or a string that
    starts with "not-image:" and says what the bytes look like.
    """
    if not data:
        return "not-image:empty file (0 bytes)"
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if len(data) > 2 and data[0:1] == b"P" and data[1:2] in b"1234567" and data[2:3].isspace():
        return "pnm"
    if data.startswith(b"\x1f\x8b"):
        return "not-image:gzip-compressed data, not an image (decompress it first)"
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<body")):
        return "not-image:HTML/XML text, not an image (a failed download?)"
    return f"not-image:unrecognised file type (first bytes {data[:8].hex()})"


def image_size(data: bytes, kind: str) -> tuple[int, int] | None:
    """(height, width) as the header of a JPEG or PNG says (the formats a store holds),
    read without decoding; None where the header says none (malformed, or another kind).
    A store's reader compares it with the index before anything decodes: a record that
    says one size and holds another (a decompression bomb behind a small index entry)
    never reaches a decoder."""
    if kind == "png":
        return png_size(data)
    if kind == "jpeg":
        return jpeg_size(data)
    return None


def header_problem(
    data: bytes, kind: str, height: int, width: int, channels: int | None = None
) -> str | None:
    """What differs between the size ``data``'s header gives (``image_size``) and the
    index's ``height`` x ``width``, or None: the check every reader and ``ingest verify``
    make before anything decodes. Pixels (``raw``) have no header: their length must be
    the index's pixels, of its ``channels`` (gray or RGB where it is not given)."""
    if kind == "raw":
        sizes = (height * width, 3 * height * width) if channels is None else (
            channels * height * width,)  # fmt: skip
        if height * width and len(data) in sizes:
            return None
        take = " or ".join(str(n) for n in sizes)
        return f"the pixels are {len(data)} bytes, where {width}x{height} pixels take {take}"
    size = image_size(data, kind)
    if size == (height, width):
        return None
    says = "no readable size" if size is None else f"{size[1]}x{size[0]} pixels"
    return f"the {kind.upper()} header gives {says}, the index {width}x{height}"
