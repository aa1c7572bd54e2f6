"""Cheap header inspection: what a file is (magic bytes) and, for JPEGs, how it is coded."""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class JpegInfo:
    height: int
    width: int
    components: int  # 1 gray, 3 YCbCr (or RGB), 4 CMYK/YCCK
    precision: int  # bits per sample, 8 for nearly all files
    sof: int  # SOF marker: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    subsampling: str  # "gray", "4:4:4", "4:2:0", ... (see ingest.format.SUBSAMPLING_CODES)
    orientation: int  # EXIF orientation 1..8 (1 when absent)
    adobe_transform: int  # Adobe APP14 transform flag, -1 when absent
    scan: int = -1  # offset of the first start-of-scan marker, -1 when the header has none

    @property
    def progressive(self) -> bool:
        return self.sof in (0xC2, 0xC6, 0xCA, 0xCE)

    @property
    def plain(self) -> bool:
        """True when every decoder the loader uses reads it as-is (no re-encode needed)."""
        return (
            self.sof in (0xC0, 0xC1, 0xC2)
            and self.precision == 8
            and self.components in (1, 3)
            and self.adobe_transform != 0  # 3 components without YCbCr transform = RGB JPEG
            and self.orientation == 1
        )


class JpegHeaderError(ValueError):
    pass


_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # markers without a length or payload


def _segments(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """The JPEG's marker segments after SOI, as (offset, marker, payload), up to and with
    the first start of scan (its payload: its own header only); never reads pixels.

    Raises:
        JpegHeaderError: a byte that is not a marker where one should be, or a segment
            that runs past the end.
    """
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            raise JpegHeaderError(f"bad marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        seg = data[pos + 4 : pos + 2 + length]
        if len(seg) != length - 2:
            raise JpegHeaderError("header truncated")
        yield pos, marker, seg
        if marker == 0xDA:  # start of scan: the header is over
            return
        pos += 2 + length


def parse_jpeg(data: bytes) -> JpegInfo:
    """Read the JPEG marker segments up to the first scan; never decodes pixels.

    Raises:
        JpegHeaderError: the header is truncated or malformed.
    """
    orientation, adobe, frame, scan = None, -1, None, -1
    for pos, marker, seg in _segments(data):
        if marker == 0xE1 and seg.startswith(b"Exif\x00\x00") and orientation is None:
            orientation = _exif_orientation(seg[6:])  # the first EXIF block's, as PIL's
        elif marker == 0xEE and seg.startswith(b"Adobe") and len(seg) >= 12:
            adobe = seg[11]
        elif marker in _SOF_MARKERS and frame is None:
            frame = (marker, seg)
        elif marker == 0xDA:
            scan = pos
    if frame is None:
        raise JpegHeaderError("no frame header (SOF) before the image data")
    return _frame_info(*frame, orientation or 1, adobe, scan)


def without_icc(data: bytes) -> bytes:
    """``data`` without its ICC profile segments (APP2 "ICC_PROFILE"), the header walked
    up to the first scan; ``data`` itself where it has none or the header is malformed.
    libjpeg-turbo's strict decode warns about a malformed one ("bad ICC marker"); OpenCV's
    decode never reads them, and the pixels are the same either way."""
    if data.find(b"ICC_PROFILE\x00", 0, 1 << 20) < 0:  # in the header, if anywhere
        return data
    cuts = []
    try:
        for pos, marker, seg in _segments(data):
            if marker == 0xE2 and seg.startswith(b"ICC_PROFILE\x00"):
                cuts.append((pos, pos + 4 + len(seg)))
    except JpegHeaderError:
        return data
    kept, start = [], 0
    for a, b in cuts:
        kept.append(data[start:a])
        start = b
    return b"".join(kept) + data[start:]


def image_size(data: bytes, kind: str) -> tuple[int, int] | None:
    """(height, width) as the header of a JPEG or PNG says (the formats a store holds),
    read without decoding; None where the header says none (malformed, or another kind).
    A store's reader compares it with the index before anything decodes: a record that
    says one size and holds another (a decompression bomb behind a small index entry)
    never reaches a decoder."""
    if kind == "png":
        if len(data) >= 24 and data[12:16] == b"IHDR":
            width, height = struct.unpack_from(">II", data, 16)
            return height, width
        return None
    if kind == "jpeg" and data.startswith(b"\xff\xd8"):
        try:
            for _pos, marker, seg in _segments(data):
                if marker in _SOF_MARKERS and len(seg) >= 5:
                    height, width = struct.unpack_from(">HH", seg, 1)
                    return height, width
        except JpegHeaderError:
            return None
    return None


def header_problem(data: bytes, kind: str, height: int, width: int) -> str | None:
    """What differs between the size ``data``'s header gives (``image_size``) and the
    index's ``height`` x ``width``, or None: the check every reader and ``ingest verify``
    make before anything decodes."""
    size = image_size(data, kind)
    if size == (height, width):
        return None
    says = "no readable size" if size is None else f"{size[1]}x{size[0]} pixels"
    return f"the {kind.upper()} header gives {says}, the index {width}x{height}"


def _frame_info(sof: int, seg: bytes, orientation: int, adobe: int, scan: int) -> JpegInfo:
    if len(seg) < 6:
        raise JpegHeaderError("frame header too short")
    precision, height, width, ncomp = struct.unpack_from(">BHHB", seg, 0)
    if len(seg) < 6 + 3 * ncomp or height == 0 or width == 0:
        raise JpegHeaderError(f"bad frame header ({width}x{height}, {ncomp} components)")
    factors = [(seg[7 + 3 * i] >> 4, seg[7 + 3 * i] & 15) for i in range(ncomp)]
    return JpegInfo(
        height, width, ncomp, precision, sof, _subsampling(factors), orientation, adobe, scan
    )


# In entropy-coded data a 0xFF byte is followed by 0x00 (stuffing), a restart marker or
# more 0xFF fill bytes; anything else is a marker, and only these may sit between scans.
# (A look-ahead, not "\xff+(...)": that form backtracks and runs ~20x slower.)
_MARKER = re.compile(rb"\xff(?![\x00\xd0-\xd7\xff])")
_BETWEEN_SCANS = {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}


def walk_scans(data: bytes, info: JpegInfo) -> tuple[str | None, int | None, int]:
    """The image data's marker structure, walked once from the first scan to its end: (what
    is wrong with it, or None, also when the data ends early: decoding tells truncation;
    where the image ends, or None where its scans reach no end-of-image marker; how many
    scans it has, as far as it was walked: a progressive decode's cost grows with them).

    libjpeg (so OpenCV and PIL) only warns about a bad marker in the image data, fills the
    rest with gray and returns an image: random or overwritten data would pass decoding.
    The end is the offset just past the end-of-image marker that closes the scans: what
    follows is no decoder's (a phone's motion-photo video, a second picture, padding);
    one inside a marker segment (an EXIF thumbnail's) is not the image's."""
    pos, n, scans = info.scan, len(data), 0
    while pos >= 0:
        if pos + 4 > n:
            return None, None, scans
        scans += data[pos + 1] == 0xDA
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if end > n:
            return f"marker segment at byte {pos} runs past the end of the file", None, scans
        m = _MARKER.search(data, end)
        pos = m.start() if m else n
        if pos + 1 >= n:
            return None, None, scans
        marker = data[pos + 1]
        if marker == 0xD9:  # end of image
            return None, pos + 2, scans
        if marker not in _BETWEEN_SCANS:
            problem = f"unexpected marker 0xFF{marker:02X} in the image data at byte {pos}"
            return problem, None, scans
    return None, None, scans


def _subsampling(factors: list[tuple[int, int]]) -> str:
    if len(factors) == 1:
        return "gray"
    (h0, v0), rest = factors[0], factors[1:]
    if len(factors) != 3 or any(f != rest[0] for f in rest) or rest[0] != (1, 1):
        return "4:4:4" if all(f == factors[0] for f in factors) else "other"
    return {
        (1, 1): "4:4:4",
        (2, 1): "4:2:2",
        (2, 2): "4:2:0",
        (1, 2): "4:4:0",
        (4, 1): "4:1:1",
    }.get((h0, v0), "other")


# SBYTE, SHORT, LONG, SSHORT, SLONG, FLOAT, DOUBLE: PIL takes any number that is whole
_EXIF_INTEGERS = {6: "b", 3: "H", 4: "I", 8: "h", 9: "i", 11: "f", 12: "d"}
_EXIF_RATIONALS = {5: "II", 10: "ii"}  # RATIONAL, SRATIONAL: stored at an offset


def _exif_orientation(tiff: bytes) -> int:
    """Orientation tag (0x0112) of IFD0 in an EXIF TIFF block, as PIL's ``exif_transpose``
    takes it: the first value, of an integer type or a rational that equals one, 1..8; 1
    when absent, unreadable or anything else (PIL then rotates nothing)."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    end = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(end + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(end + "H", tiff, ifd)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            return 1
        tag, typ, count = struct.unpack_from(end + "HHI", tiff, entry)
        if tag != 0x0112:
            continue
        value, code = None, _EXIF_INTEGERS.get(typ) or _EXIF_RATIONALS.get(typ)
        if count >= 1 and code:  # several values: PIL warns and takes the first
            at = entry + 8  # the values themselves where they fit in 4 bytes, else where
            size = count * struct.calcsize(code)
            if size > 4:
                (at,) = struct.unpack_from(end + "I", tiff, at)
            if at + size <= len(tiff):  # PIL skips a tag whose values run past the block
                value = struct.unpack_from(end + code, tiff, at)
        if value is not None and len(value) == 2:  # a rational: one only if it is whole
            num, den = value
            value = (num // den,) if den and num % den == 0 else None
        return int(value[0]) if value is not None and value[0] in range(1, 9) else 1
    return 1


class PngError(ValueError):
    """A PNG that libpng would refuse or warn about (the reason says what)."""


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2))  # fmt: skip
_KEPT = (b"IHDR", b"PLTE", b"IDAT", b"IEND")


def plain_png(data: bytes) -> bytes:
    """``data`` checked as libpng would read it, with only its critical chunks (IHDR, PLTE,
    IDAT, IEND): what libpng decodes from it without a word on stderr.

    Every chunk's CRC, the header's values, the chunks' order, and the image data: a zlib
    stream that ends exactly with the bytes the header's size needs, each row's filter
    type valid. The ancillary chunks (colour profiles, gamma, text, transparency) are left
    out: decoding to 8-bit colour does not read them, and libpng warns about a bad one.
    The same whether a worker or the training process decodes it (a warning there could
    not be kept off the terminal).

    Raises:
        PngError: what is wrong.
    """
    if not data.startswith(_PNG_SIGNATURE):
        raise PngError("no PNG signature")
    chunks, pos = [], len(_PNG_SIGNATURE)
    while pos < len(data):
        if pos + 12 > len(data):
            raise PngError(f"truncated chunk at byte {pos}")
        (length,) = struct.unpack_from(">I", data, pos)
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if len(body) != length or pos + 12 + length > len(data):
            raise PngError(f"chunk {kind!r} runs past the end of the data")
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        if zlib.crc32(kind + body) != crc:
            raise PngError(f"chunk {kind!r} has a bad CRC")
        chunks.append((kind, body))
        pos += 12 + length
        if kind == b"IEND":
            break
    if pos != len(data) or not chunks or chunks[-1] != (b"IEND", b""):
        raise PngError("no end chunk (IEND) at the end")
    kinds = [kind for kind, _ in chunks]
    for kind in kinds:
        if kind[:1].isupper() and kind not in _KEPT:
            raise PngError(f"unknown critical chunk {kind!r}")
    if kinds[0] != b"IHDR" or len(chunks[0][1]) != 13 or kinds.count(b"IHDR") != 1:
        raise PngError("no valid header chunk (IHDR) first")
    header = struct.unpack(">IIBBBBB", chunks[0][1])
    width, height, depth, color, method, filtering, interlace = header
    if not (0 < width < 2**31 and 0 < height < 2**31) or depth not in _PNG_DEPTHS.get(color, ()):
        raise PngError(f"bad header: {width}x{height}, depth {depth}, colour type {color}")
    if method or filtering or interlace > 1:
        raise PngError("bad header: unknown compression, filter or interlace method")
    idat = [k for k, kind in enumerate(kinds) if kind == b"IDAT"]
    if not idat or idat != list(range(idat[0], idat[-1] + 1)):
        raise PngError("the image data chunks (IDAT) are missing or not consecutive")
    palettes = [body for kind, body in chunks if kind == b"PLTE"]
    if color == 3 and (len(palettes) != 1 or not _palette_ok(palettes[0], depth)):
        raise PngError("a palette image without one valid palette (PLTE)")
    if kinds.count(b"IEND") != 1 or (b"PLTE" in kinds and kinds.index(b"PLTE") > idat[0]):
        raise PngError("chunks out of order")
    bits = depth * _PNG_CHANNELS[color]
    passes = ((height, width),) if not interlace else tuple(
        (-(-(height - y) // dy), -(-(width - x) // dx))
        for x, y, dx, dy in _ADAM7 if height > y and width > x
    )  # fmt: skip
    stride = [1 + -(-w * bits // 8) for _, w in passes]
    need = sum(h * s for (h, _), s in zip(passes, stride, strict=True))
    stream = zlib.decompressobj()
    try:
        pixels = stream.decompress(b"".join(chunks[k][1] for k in idat), need + 1)
    except zlib.error as e:
        raise PngError(f"the image data does not decompress: {e}") from None
    if len(pixels) != need or not stream.eof or stream.unused_data or stream.unconsumed_tail:
        raise PngError(f"the image data is not the {need} bytes the header needs")
    start = 0
    for (h, _), s in zip(passes, stride, strict=True):
        if max(pixels[start : start + h * s : s]) > 4:
            raise PngError("a row has an unknown filter type")
        start += h * s
    return png_critical(data)  # its chunks checked whole: the same bytes, taken as they are


def png_end(data: bytes) -> int | None:
    """Where a PNG ends: the offset just past its end chunk (IEND), found by the chunks'
    lengths; None where the chunks reach none (checks nothing else: ``plain_png`` does)."""
    for kind, start, length in _png_walk(data):
        if kind == b"IEND":
            end = start + length + 4
            return end if end <= len(data) else None
    return None


def png_has_exif(data: bytes) -> bool:
    """Whether a PNG carries EXIF data where PIL finds it (an ``eXIf`` chunk, or a text
    chunk "Raw profile type exif"): its orientation is then PIL's to apply."""
    for kind, start, length in _png_walk(data):
        if kind == b"eXIf":
            return True
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            keyword = data[start : start + min(length, 80)].split(b"\0", 1)[0]
            if keyword.lower() == b"raw profile type exif":
                return True
    return False


def png_critical(data: bytes) -> bytes:
    """A PNG's critical chunks as they are (no CRC or image data checked: cheap), what a
    store of converter version 3 holds; ``data`` itself where it has nothing else or does
    not walk to its end chunk."""
    chunks = [(kind, start - 8, start + length + 4) for kind, start, length in _png_walk(data)]
    if not chunks or chunks[-1][0] != b"IEND" or chunks[-1][2] > len(data):
        return data
    kept = _PNG_SIGNATURE + b"".join(data[a:b] for kind, a, b in chunks if kind in _KEPT)
    return data if len(kept) == len(data) else kept


def _png_walk(data: bytes) -> Iterator[tuple[bytes, int, int]]:
    """A PNG's chunks by their lengths, as (type, offset of the body, length), up to and
    with IEND; nothing checked."""
    pos = len(_PNG_SIGNATURE)
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4 : pos + 8]
        yield kind, pos + 8, length
        if kind == b"IEND":
            return
        pos += 12 + length


def _palette_ok(palette: bytes, depth: int) -> bool:
    return len(palette) % 3 == 0 and 0 < len(palette) // 3 <= 2**depth
