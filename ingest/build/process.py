"""One source file made into a record: read, verified and normalised, packed; or a reject
with its reason (a decoder's surprise on one file rejects that file, never the build)."""

from __future__ import annotations

import zlib
from collections import Counter

import numpy as np

from ingest import format as fmt
from ingest.build.options import BuildOptions
from ingest.cstderr import captured
from ingest.format.codec import compress, pack_record, record_limit
from ingest.format.safeio import FileRefused, read_regular
from ingest.images.normalize import OBJECT_AT, Options, Reject, convert

Result = tuple[list, bytes]  # process_file's: (header, record)


def process_file(job: tuple, options: BuildOptions) -> Result:
    """One source file: (["ok", index row without shard, fixes], record) or
    (["reject", path, reason], b"")."""
    path, rel, label = job
    stored = fmt.path_value(rel)
    try:
        data = read_regular(path, options.max_file_bytes)
        opts = Options(options.verify, options.max_size, options.quality, options.max_pixels)
        with captured() as warnings:  # what libjpeg, libtiff... print: never on the terminal
            conv = convert(data, opts)
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
    record = {
        "image": compress(conv.payload, options.compression),
        "label": label,
        "path": stored,
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
    if len(value) > limit:  # as every reader would refuse it, unread
        why = f"{len(value)} bytes for {conv.width}x{conv.height} pixels (at most {limit})"
        return ["reject", stored, f"too many bytes for its pixels: {why}"], b""
    flags = (
        fmt.FLAG_PROGRESSIVE * conv.progressive
        | fmt.FLAG_REENCODED * (not data.startswith(conv.payload))
        | fmt.FLAG_COMPRESSED * (record["compression"] is not None)
    )
    row = [label, len(value), conv.height, conv.width, zlib.crc32(value),
           fmt.FORMAT_CODES[conv.format], flags, conv.channels,
           fmt.SUBSAMPLING_CODES.get(conv.subsampling or "", 0)]  # fmt: skip
    return ["ok", row, conv.fixes], value


def format_mix(rows: np.ndarray) -> Counter:
    """The format mix of some index rows, as counted in the manifest's stats."""
    jpeg = rows["format"] == fmt.FORMAT_CODES["jpeg"]
    progressive = (rows["flags"] & fmt.FLAG_PROGRESSIVE) != 0
    counts = {
        "jpeg baseline": jpeg & ~progressive,
        "jpeg progressive": jpeg & progressive,
        "png": rows["format"] == fmt.FORMAT_CODES["png"],
        "re-encoded": (rows["flags"] & fmt.FLAG_REENCODED) != 0,
    }
    return Counter({name: int(mask.sum()) for name, mask in counts.items() if mask.any()})
