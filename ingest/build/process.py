"""One source file made into a record: read, verified and normalised, packed; or a reject
with its reason (a decoder's surprise on one file rejects that file, never the build)."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from ingest import format as fmt
from ingest.build.encoding import raw_share, stored_as_pixels
from ingest.build.options import BuildOptions
from ingest.cstderr import captured
from ingest.format.checksum import crc32
from ingest.format.codec import compress, pack_record, record_limit
from ingest.format.safeio import FileRefused, read_regular
from ingest.images.normalize import OBJECT_AT, Converted, Options, Reject, convert
from ingest.images.raw import to_pixels

Result = tuple[list, bytes]  # process_file's: (header, record)


def process_file(job: tuple, options: BuildOptions) -> Result:
    """One source file: (["ok", index row without shard, fixes, stored], record) or
    (["reject", path, reason], b""). ``stored``: the number of bytes of its image where
    they are the file's first ones (the file stored as it is), else 0 (``Known``)."""
    path, rel, _ = job
    stored = fmt.path_value(rel)
    try:
        data = read_regular(path, options.max_file_bytes)
        opts = Options(options.verify, options.max_size, options.quality, options.max_pixels)
        with captured() as warnings:  # what libjpeg, libtiff... print: never on the terminal
            conv = convert(data, opts)
            if stored_as_pixels(stored, raw_share(options.encoding)):
                conv = to_pixels(conv)
        if warnings and conv.source_format == "jpeg":
            warning = warnings[0].removeprefix("Corrupt JPEG data: ")
            raise Reject(f"corrupt JPEG data: the decoder warns: {warning}")
    except FileRefused as e:
        hint = " (--max-file-size)" if str(e).startswith("too large") else ""
        return ["reject", stored, f"{e}{hint}"], b""
    except Reject as e:
        return ["reject", stored, str(e)], b""
    except Exception as e:  # a decoder's surprise on one file rejects that file, not the build
        said = OBJECT_AT.sub("", str(e))  # the same reason in every build
        return ["reject", stored, f"could not convert: {type(e).__name__}: {said}"], b""
    as_is = conv.format != "raw" and data.startswith(conv.payload)
    flags = fmt.FLAG_PROGRESSIVE * conv.progressive | fmt.FLAG_REENCODED * (not as_is)
    made = _made(job, conv, flags, options)
    if isinstance(made, str):  # as every reader would refuse it, unread
        return ["reject", stored, f"too many bytes for its pixels: {made}"], b""
    return ["ok", made[0], conv.fixes, len(conv.payload) * as_is], made[1]


class Known(NamedTuple):
    """What a build's first pass found of a record: enough to check the record made again,
    and to make again one stored as it is without parsing its file. ``stored``: the bytes
    of its image, which are the file's first ones; 0 when a conversion made it."""

    nbytes: int
    crc32: int
    height: int
    width: int
    format: int  # FORMAT_CODES
    flags: int
    channels: int
    subsampling: int  # SUBSAMPLING_CODES, 0 when not a JPEG
    stored: int


def known_records(rows: np.ndarray, stored: np.ndarray) -> list[Known]:
    """``Known`` of each of some index rows (INDEX_DTYPE) and their stored image sizes."""
    columns = [rows[name].tolist() for name in Known._fields[:-1]]
    return [Known(*fields) for fields in zip(*columns, stored.tolist(), strict=True)]


def stored_again(job: tuple, known: Known, options: BuildOptions) -> tuple[list, bytes] | None:
    """(index row, record) of a file stored as it is (``known.stored``), made again from
    the file's first bytes and what the first pass found, without parsing or decoding it:
    a write pass's quick way. The caller checks it against ``known`` (and makes it the long way
    when it differs); None where it cannot be made so: the file is no longer there to
    read whole, is shorter than its image, or the plan's format or size is not one a
    record takes."""
    try:
        data = read_regular(job[0], options.max_file_bytes)
    except FileRefused:
        return None
    name = fmt.FORMAT_NAMES.get(known.format)
    if len(data) < known.stored or name is None:
        return None
    dropped = len(data) - known.stored
    conv = Converted(
        data[: known.stored], name, name, known.height, known.width, known.channels,
        bool(known.flags & fmt.FLAG_PROGRESSIVE), fmt.SUBSAMPLING_NAMES.get(known.subsampling),
        [f"trailing-bytes-dropped:{dropped}"] if dropped else [],
    )  # fmt: skip
    made = _made(job, conv, known.flags & ~fmt.FLAG_COMPRESSED, options)
    return None if isinstance(made, str) else made


def _made(
    job: tuple, conv: Converted, flags: int, options: BuildOptions
) -> tuple[list, bytes] | str:
    """The (index row without shard, record) of a converted image (``flags`` but
    FLAG_COMPRESSED, which ``options`` decide); the reason its record is too large for
    its pixels, where it is."""
    _, rel, label = job
    record = {
        "image": compress(conv.payload, options.compression),
        "label": label,
        "path": fmt.path_value(rel),
        "height": conv.height,
        "width": conv.width,
        "channels": conv.channels,
        "format": conv.format,
        "source_format": conv.source_format,
        "progressive": conv.progressive,
        "subsampling": conv.subsampling,
        "compression": None if options.compression.name == "none" else options.compression.name,
        "fixes": conv.fixes,
    }
    value = pack_record(record)
    limit = record_limit(conv.height, conv.width)
    if len(value) > limit:
        return f"{len(value)} bytes for {conv.width}x{conv.height} pixels (at most {limit})"
    flags |= fmt.FLAG_COMPRESSED * (record["compression"] is not None)
    row = [label, len(value), conv.height, conv.width, crc32(value),
           fmt.FORMAT_CODES[conv.format], flags, conv.channels,
           fmt.SUBSAMPLING_CODES.get(conv.subsampling or "", 0)]  # fmt: skip
    return row, value


def format_mix(rows: np.ndarray) -> Counter:
    """The format mix of some index rows, as counted in the manifest's stats."""
    jpeg = rows["format"] == fmt.FORMAT_CODES["jpeg"]
    progressive = (rows["flags"] & fmt.FLAG_PROGRESSIVE) != 0
    counts = {
        "jpeg baseline": jpeg & ~progressive,
        "jpeg progressive": jpeg & progressive,
        "png": rows["format"] == fmt.FORMAT_CODES["png"],
        "raw pixels": rows["format"] == fmt.FORMAT_CODES["raw"],
        "re-encoded": (rows["flags"] & fmt.FLAG_REENCODED) != 0,
    }
    return Counter({name: int(mask.sum()) for name, mask in counts.items() if mask.any()})
