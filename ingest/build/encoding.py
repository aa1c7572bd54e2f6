"""Which samples a build stores as pixels (``--encoding``): none (``jpeg``, the default),
all (``raw``), or a share of them (``mixed:SHARE``).

A pixel record skips the decode that bounds small fast models at training time, for
about five times a JPEG's bytes (docs/encodings.md). In a mixed store the share is
drawn per sample from its path (SHA-256), not by size or order: the same SRC gives the
same mix on every run, worker count and resume (nothing about the sample but its name
decides), and each batch of a shuffled epoch holds about the same share of pixels, so
the loader's pace is steady rather than fast and slow by turns.
"""

from __future__ import annotations

import functools
import hashlib

ENCODINGS = "jpeg, raw or mixed:SHARE (SHARE between 0 and 1: the part stored as pixels)"


def parse_encoding(text: str) -> str:
    """The canonical spelling of an ``--encoding`` value.

    Raises:
        ValueError: not one of ``ENCODINGS``.
    """
    name, colon, share = str(text).strip().lower().partition(":")
    if name in ("jpeg", "raw") and not colon:
        return name
    if name == "mixed":
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if 0.0 < value < 1.0:
            return f"mixed:{value!r}"  # exactly the share drawn by, never rounded to 0 or 1
    raise ValueError(f"--encoding {text!r} is invalid: pass {ENCODINGS}")


@functools.cache  # asked for every file of a build
def raw_share(encoding: str) -> float:
    """The part of the samples an encoding stores as pixels: 0, 1 or the mixed share."""
    if encoding == "jpeg":
        return 0.0
    if encoding == "raw":
        return 1.0
    return float(encoding.partition(":")[2])


def stored_as_pixels(path: str | bytes, share: float) -> bool:
    """Whether the sample at ``path`` (as the record stores it) is stored as pixels."""
    if share <= 0.0 or share >= 1.0:
        return share >= 1.0
    name = path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")
    draw = int.from_bytes(hashlib.sha256(b"imfeed-pixels\0" + name).digest()[:8], "big")
    return draw < share * 2**64
