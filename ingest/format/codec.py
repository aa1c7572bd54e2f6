"""Record pack/unpack (msgpack maps), their checks, and the payload compression registry
("zstd:3")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import msgpack

from ingest.format.layout import FORMAT_CODES

# Keys every record has (docs/FORMAT.md, "Records").
RECORD_KEYS = (
    "image",
    "label",
    "path",
    "height",
    "width",
    "channels",
    "format",
    "source_format",
    "progressive",
    "subsampling",
    "compression",
    "fixes",
)

COMPRESSORS = ("none", "zstd")
ZSTD_DEFAULT_LEVEL = 3


@dataclass(frozen=True)
class Compression:
    """A parsed ``--compression`` value: a name from COMPRESSORS and a level."""

    name: str = "none"
    level: int = 0

    def __str__(self) -> str:
        return self.name if self.name == "none" else f"{self.name}:{self.level}"


def parse_compression(spec: str | None) -> Compression:
    """Parse "none", "zstd" or "zstd:LEVEL" (LEVEL 1..22).

    Raises:
        ValueError: unknown name or bad level, with the accepted forms.
    """
    if spec in (None, "", "none"):
        return Compression()
    name, _, level = str(spec).partition(":")
    if name != "zstd":
        raise ValueError(
            f"--compression {spec!r}: unknown compressor {name!r}; "
            "use one of: none, zstd, zstd:LEVEL"
        )
    try:
        lvl = int(level) if level else ZSTD_DEFAULT_LEVEL
    except ValueError:
        raise ValueError(f"--compression {spec!r}: level must be an integer 1..22") from None
    if not 1 <= lvl <= 22:
        raise ValueError(f"--compression {spec!r}: level {lvl} is outside 1..22")
    return Compression("zstd", lvl)


# zstd contexts are not fork-safe: keep one per process (and per level).
_ZSTD: dict[Any, Any] = {}


def _zstd(kind: str, level: int = 0):
    key = (os.getpid(), kind, level)
    ctx = _ZSTD.get(key)
    if ctx is None:
        import zstandard

        ctx = zstandard.ZstdCompressor(level=level) if kind == "c" else zstandard.ZstdDecompressor()
        _ZSTD[key] = ctx
    return ctx


def compress(data: bytes, compression: Compression) -> bytes:
    if compression.name == "none":
        return data
    return _zstd("c", compression.level).compress(data)


def decompress(data: bytes, name: str | None, limit: int | None = None) -> bytes:
    """``data`` decompressed by codec ``name``; with ``limit``, a frame that says or makes
    more than ``limit`` bytes is refused (ValueError) before anything is allocated for it:
    a record is untrusted, and a few KiB of zstd can say gigabytes."""
    if not name or name == "none":
        return data
    if name == "zstd":
        # Frames written by ZstdCompressor.compress carry their content size.
        if limit is not None:
            import zstandard

            size = zstandard.frame_content_size(data)
            if size > limit:
                raise ValueError(f"the frame says {size} bytes, over the {limit} its image needs")
            return _zstd("d").decompress(data, max_output_size=limit)
        return _zstd("d").decompress(data)
    raise ValueError(f"unknown record compression {name!r}; known: {', '.join(COMPRESSORS)}")


def pack_record(record: dict) -> bytes:
    """Serialise a record map; keys sorted so equal records give equal bytes."""
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"record is missing keys {missing}")
    return msgpack.packb(dict(sorted(record.items())), use_bin_type=True)


def unpack_record(value: bytes | memoryview) -> dict:
    """Parse a stored value into a record map (no code runs: msgpack, never pickle)."""
    return msgpack.unpackb(value, raw=False, strict_map_key=True)


def check_record(record: object) -> str | None:
    """What makes an unpacked record unusable (not a map, a field of the wrong type), or
    None. Readers check this before using a record: a store is untrusted input."""
    if not isinstance(record, dict):
        return f"not a map but {type(record).__name__}"
    for key, types in _RECORD_TYPES.items():
        if not isinstance(record.get(key), types):
            return f"field {key!r} is {type(record.get(key)).__name__}, not {types[0].__name__}"
    if record["format"] not in FORMAT_CODES:
        return f"unknown image format {record['format']!r}"
    if not isinstance(record.get("path", ""), (str, bytes)):
        return f"field 'path' is {type(record['path']).__name__}, not str"
    return None


_RECORD_TYPES = {"image": (bytes,), "label": (int,), "format": (str,), "height": (int,),
                 "width": (int,), "compression": (str, type(None))}  # fmt: skip


def image_bytes(record: dict, limit: int | None = None) -> bytes:
    """The encoded image of a record, decompressed (at most ``limit`` bytes: see
    ``encoded_limit``)."""
    return decompress(record["image"], record.get("compression"), limit)


def encoded_limit(height: int, width: int) -> int:
    """The most bytes an encoded image of ``height`` x ``width`` pixels may take: twice its
    pixels as RGBA, and 64 MiB for its metadata (no JPEG or PNG of it needs more)."""
    return 8 * height * width + (64 << 20)


def payload_limit(kind: str, height: int, width: int) -> int:
    """The most bytes the decompressed image of a record of ``kind`` may take: its pixels
    exactly for pixels (``raw``), else ``encoded_limit``."""
    return 3 * height * width if kind == "raw" else encoded_limit(height, width)


def row_problem(record: dict, row) -> str | None:
    """What differs between a checked pixel record's own fields and its index row, or
    None: pixels have no header to check against the row (a JPEG's or PNG's is checked,
    ``header_problem``), so their format, size and channels must be the row's, and a row
    of pixels must hold pixels."""
    code, raw = int(row["format"]), FORMAT_CODES["raw"]
    if record["format"] != "raw" and code != raw:
        return None
    if FORMAT_CODES[record["format"]] != code:
        return f"its format {record['format']!r} differs from the index's (code {code})"
    height, width, channels = int(row["height"]), int(row["width"]), int(row["channels"])
    if (record["height"], record["width"]) != (height, width):
        return (f"its size {record['width']}x{record['height']} differs from the index's "
                f"{width}x{height}")  # fmt: skip
    if record.get("channels") != channels:
        return f"its channels {record.get('channels')!r} differ from the index's ({channels})"
    return None


def record_limit(height: int, width: int) -> int:
    """The most bytes a record of an image of ``height`` x ``width`` pixels may take: the
    image's ``encoded_limit`` and 64 KiB for the other fields (its path among them). The
    build refuses a file over it, and readers a record, before reading it."""
    return encoded_limit(height, width) + (64 << 10)


def size_problem(height: int, width: int, nbytes: int, max_pixels: int) -> str | None:
    """What makes the record of an index row (``height`` x ``width`` pixels, ``nbytes``)
    refused unread by every reader: over ``max_pixels``, or longer than ``record_limit``;
    None where neither."""
    if height * width > max_pixels:
        return (f"{width}x{height} pixels is over the pixel limit of {max_pixels} (a "
                "decompression bomb?)")  # fmt: skip
    if nbytes > record_limit(height, width):
        return f"a record of {nbytes} bytes is more than an image of {width}x{height} pixels needs"
    return None
