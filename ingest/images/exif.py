"""The EXIF orientation of a JPEG, read from its TIFF block as PIL's ``exif_transpose``
reads it (so a build rotates exactly the images PIL would)."""

from __future__ import annotations

import struct

# SBYTE, SHORT, LONG, SSHORT, SLONG, FLOAT, DOUBLE: PIL takes any number that is whole
_EXIF_INTEGERS = {6: "b", 3: "H", 4: "I", 8: "h", 9: "i", 11: "f", 12: "d"}
_EXIF_RATIONALS = {5: "II", 10: "ii"}  # RATIONAL, SRATIONAL: stored at an offset


def exif_orientation(tiff: bytes) -> int:
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
