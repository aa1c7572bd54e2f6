"""JPEG headers read without decoding a pixel: the frame (size, components, subsampling,
coding), the EXIF orientation as PIL takes it, the ICC segments, and one walk over the
image data's markers, which libjpeg only warns about (and then fills with gray)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from ingest.images.exif import exif_orientation


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
            orientation = exif_orientation(seg[6:])  # the first EXIF block's, as PIL's
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


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) as a JPEG's first frame header says; None where there is none
    (not a JPEG, or a malformed header)."""
    if data.startswith(b"\xff\xd8"):
        try:
            for _pos, marker, seg in _segments(data):
                if marker in _SOF_MARKERS and len(seg) >= 5:
                    height, width = struct.unpack_from(">HH", seg, 1)
                    return height, width
        except JpegHeaderError:
            return None
    return None


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
# (A look-ahead, not "\xff+(...)": that form backtracks, and is far slower.)
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
