"""Verify one source image and normalise it into a payload every loader decoder reads.

Plain 8-bit JPEGs (baseline, or progressive of at most ``KEPT_SCANS`` scans; gray or
YCbCr; upright) are stored byte for byte, and 8-bit gray/RGB PNGs with their critical
chunks byte for byte. Everything else that decodes is converted once, here:
EXIF orientation applied (as PIL's ``ImageOps.exif_transpose``), CMYK/YCCK to RGB,
16-bit to 8-bit, palette and alpha to RGB (alpha dropped, as ``Image.convert("RGB")``
does), other formats (GIF, BMP, TIFF, WEBP, PNM) to PNG. JPEG sources are re-encoded
as baseline JPEG at ``quality``; other sources as lossless PNG.
"""

from __future__ import annotations

import re
import struct
import warnings
from dataclasses import dataclass, field

import cv2
import numpy as np
import simplejpeg
from PIL import Image, ImageOps

from ingest.format import DEFAULT_MAX_PIXELS
from ingest.images.jpeg import JpegHeaderError, JpegInfo, parse_jpeg, walk_scans, without_icc
from ingest.images.pixels import (
    bgr,
    channels,
    open_unlimited,
    pil_orientation,
    png_bit_depth,
    resize,
    to_8bit,
)
from ingest.images.png import PngError, plain_png, png_end, png_has_exif
from ingest.images.probe import sniff

cv2.setNumThreads(1)

# A progressive JPEG's decode costs a pass over its coefficients per scan: libjpeg's own
# scripts make 6-10 scans, and hundreds multiply a decode's cost. Over KEPT_SCANS
# the build decodes it once and stores it as baseline; over MAX_SCANS it is refused.
KEPT_SCANS = 64
MAX_SCANS = 1000


class Reject(Exception):
    """The file is not a usable image; ``str(self)`` is the reason recorded in rejects.jsonl."""


@dataclass
class Converted:
    payload: bytes
    format: str  # "jpeg" or "png"; "raw" (pixels) once ``raw.to_pixels`` made it
    source_format: str
    height: int
    width: int
    channels: int
    progressive: bool = False
    subsampling: str | None = None
    fixes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    verify: bool = True
    max_size: int | None = None  # cap on the longer side, in pixels
    quality: int = 95  # JPEG quality of re-encoded JPEG sources
    max_pixels: int = DEFAULT_MAX_PIXELS  # width x height above which an image is refused


def convert(data: bytes, opts: Options) -> Converted:
    """Check ``data`` and return what to store for it.

    Raises:
        Reject: empty, not an image, truncated or corrupt.
    """
    kind = sniff(data)
    if kind.startswith("not-image:"):
        raise Reject(kind.split(":", 1)[1])
    if kind == "jpeg":
        try:
            info = parse_jpeg(data)
        except JpegHeaderError as e:
            raise Reject(f"corrupt JPEG header: {e}") from None
        _check_pixels(info.width, info.height, opts)
        if info.precision != 8:
            raise Reject(
                f"unsupported JPEG: {info.precision}-bit samples (the readers take 8-bit "
                "JPEGs; convert it to 8-bit)"
            )
        problem, end, scans = None, None, 0
        # Unverified, a JPEG ending as an image ends is taken to end there (a walk cost the
        # unverified build a sixth of its speed), unless its scans must be counted.
        if opts.verify or info.progressive or not data.endswith(b"\xff\xd9"):
            problem, end, scans = walk_scans(data, info)
        if opts.verify and problem:
            raise Reject(f"corrupt JPEG data: {problem}")
        if scans > MAX_SCANS:
            raise Reject(
                f"too many scans: {scans} in one JPEG (over {MAX_SCANS}; each decode of it "
                "would cost seconds): re-encode it"
            )
        if opts.verify:
            check_jpeg(data[:end], info)  # what is stored (all of it where ``end`` is None)
        kept = info.plain and scans <= KEPT_SCANS  # more: decoded once here, not each epoch
        if kept and not _too_big(info.height, info.width, opts):
            return _plain_jpeg(data, info, end)
    if kind == "png":
        kept = _plain_png(data, opts)
        if kept is not None:
            return kept
    return _via_pil(data, kind, opts)


def _too_big(height: int, width: int, opts: Options) -> bool:
    return opts.max_size is not None and max(height, width) > opts.max_size


def _check_pixels(width: int, height: int, opts: Options) -> None:
    """Refuse a decompression bomb from its header, before anything decodes it."""
    if width * height > opts.max_pixels:
        raise Reject(
            f"too many pixels: {width}x{height} is over the limit of {opts.max_pixels} "
            "(--max-pixels; a decompression bomb?)"
        )


def check_jpeg(data: bytes, info: JpegInfo | None = None) -> tuple[int, int]:
    """Check that ``data`` decodes without a warning; its (height, width), from its header.

    Decodes ``data`` with libjpeg-turbo in stop-on-warning mode, at 1/8 scale.

    libjpeg only warns about corrupt entropy-coded data or data that ends early ("Corrupt
    JPEG data: premature end of data segment") and fills the rest with gray; a warning is
    a failure here. Decoding at 1/8 scale still entropy-decodes every block of every scan
    (where corruption and truncation show) but skips most of the IDCT and colour work.

    Raises:
        Reject: the decoder fails or warns (the reason quotes it).
    """
    # A lossless JPEG (a source's, never a store's) is neither scaled nor converted.
    lossless = info is not None and info.sof in (0xC3, 0xC7, 0xCB, 0xCF)
    data = without_icc(data)  # what a decode in a worker (OpenCV) reads, no more
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace in ("CMYK", "YCCK"):
            out = "CMYK"
        else:
            out = "RGB" if lossless and info.components == 3 else "GRAY"
        least = {} if lossless else {"min_height": 1, "min_width": 1}
        simplejpeg.decode_jpeg(data, out, strict=True, **least)
    except ValueError as e:
        end = "" if _has_eoi(data) else " (truncated: no end-of-image marker)"
        warning = str(e).removeprefix("Corrupt JPEG data: ")
        raise Reject(f"corrupt JPEG data: the decoder warns: {warning}{end}") from None
    return height, width


def _plain_jpeg(data: bytes, info: JpegInfo, end: int | None) -> Converted:
    """The JPEG as it is, up to its end-of-image marker (``end``): what follows (a motion
    photo's video, a second picture, padding) no decoder reads, and every epoch would
    carry it."""
    fixes = []
    if end is not None and end < len(data):
        fixes.append(f"trailing-bytes-dropped:{len(data) - end}")
        data = data[:end]
    return Converted(
        data,
        "jpeg",
        "jpeg",
        info.height,
        info.width,
        info.components,
        info.progressive,
        info.subsampling,
        fixes,
    )


def _plain_png(data: bytes, opts: Options) -> Converted | None:
    """An 8-bit gray or RGB PNG as it is (``_png_kept``), read without PIL; None: for PIL
    to read (other depths and colour types, EXIF data, over ``max_size``, and PNGs the
    readers' check refuses, which PIL may read and the build then converts)."""
    if len(data) < 33 or data[12:16] != b"IHDR":
        return None  # PIL's to reject
    width, height, depth, color = struct.unpack_from(">IIBB", data, 16)
    _check_pixels(width, height, opts)  # before anything inflates the image data
    if depth != 8 or color not in (0, 2) or _too_big(height, width, opts) or png_has_exif(data):
        return None
    kept = _png_kept(data)
    if kept is None:
        return None
    return Converted(kept[0], "png", "png", height, width, 1 if color == 0 else 3, fixes=kept[1])


def _png_kept(data: bytes) -> tuple[bytes, list[str]] | None:
    """A PNG to store as it is, and its fixes: its critical chunks
    (``ingest.images.png.plain_png``:
    every chunk, and all the image data inflated and its rows' filters checked, as a decode
    would), which are what the loader's readers decode, where that check passes it; None:
    convert it (PIL reads some PNGs it refuses, such as one with bytes after the end of its
    image data). The ancillary chunks (text, colour profile, gamma, time) change no pixel
    any reader decodes, and one can make PIL refuse the file (a text chunk that inflates
    past its limit); what follows the end chunk no decoder reads."""
    end = png_end(data)
    kept = data if end is None else data[:end]
    try:
        plain = plain_png(kept)
    except PngError:
        return None
    dropped = len(data) - len(kept)
    fixes = [f"trailing-bytes-dropped:{dropped}"] if dropped else []
    if len(plain) != len(kept):
        fixes.append(f"png-ancillary-chunks-dropped:{len(kept) - len(plain)}")
    return plain, fixes


def _has_eoi(data: bytes) -> bool:
    # Some writers pad after the end-of-image marker, so look in the last bytes.
    return b"\xff\xd9" in data[-64:]


def _pil_load(data: bytes, kind: str, opts: Options) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = open_unlimited(data)
            _check_pixels(*img.size, opts)  # ours, from the header, before anything decodes
            img.load()
    except Reject:
        raise
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError...)
        said = OBJECT_AT.sub("", str(e))  # "<_io.BytesIO object at 0x7f...>": the same file
        raise Reject(f"corrupt {kind}: {type(e).__name__}: {said}") from None  # same reason
    return img


OBJECT_AT = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")  # an object's repr: its address


def _via_pil(data: bytes, kind: str, opts: Options) -> Converted:
    img = _pil_load(data, kind, opts)
    fixes: list[str] = []
    with warnings.catch_warnings():  # PIL's about malformed EXIF data: not the decoder's
        warnings.simplefilter("ignore")
        orientation = pil_orientation(img)
        if orientation != 1:
            img = ImageOps.exif_transpose(img)
            fixes.append(f"exif-orientation:{orientation}")
    arr = to_8bit(img, fixes)
    if kind == "png" and png_bit_depth(data) == 16 and "16bit-to-8bit" not in fixes:
        fixes.append("16bit-to-8bit")  # PIL reads 16-bit RGB(A) as 8-bit, by the high bytes
    keep = (
        kind == "png"
        and not fixes
        and not _too_big(*arr.shape[:2], opts)
        and img.mode in ("L", "RGB")
        and png_bit_depth(data) == 8
    )
    kept = _png_kept(data) if keep else None  # with EXIF data that rotates nothing
    if kept is not None:
        return Converted(kept[0], "png", kind, *arr.shape[:2], channels(arr), fixes=kept[1])
    if _too_big(*arr.shape[:2], opts):
        arr = resize(arr, opts.max_size)
        fixes.append(f"resized-from:{img.width}x{img.height}")
    if kind == "jpeg":
        return _encode_jpeg(arr, kind, fixes, opts.quality)
    if kind != "png":
        fixes.append(f"{kind}-to-png")
    return _encode_png(arr, kind, fixes)


def _encode_jpeg(arr: np.ndarray, kind: str, fixes: list[str], quality: int) -> Converted:
    ok, buf = cv2.imencode(".jpg", bgr(arr), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise Reject("could not re-encode as JPEG")
    payload = buf.tobytes()
    info = parse_jpeg(payload)
    fixes.append(f"reencoded-jpeg:q{quality}")
    return Converted(
        payload,
        "jpeg",
        kind,
        info.height,
        info.width,
        info.components,
        False,
        info.subsampling,
        fixes,
    )


def _encode_png(arr: np.ndarray, kind: str, fixes: list[str]) -> Converted:
    ok, buf = cv2.imencode(".png", bgr(arr), [cv2.IMWRITE_PNG_COMPRESSION, 3])
    if not ok:
        raise Reject("could not re-encode as PNG")
    fixes.append("reencoded-png")
    return Converted(buf.tobytes(), "png", kind, *arr.shape[:2], channels(arr), fixes=fixes)
