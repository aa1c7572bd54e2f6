"""PNGs checked as libpng reads them (every chunk, the header, the image data's exact
length and row filters) and cut to their critical chunks, which is what a store holds."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator


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


def png_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) as a PNG's header chunk says; None where it has none."""
    if len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack_from(">II", data, 16)
        return height, width
    return None


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
