"""A normalised image as a pixel record's payload: uint8 pixels, rows of HxWxC (C 1 or 3).

The pixels are the loader's CPU decode (OpenCV) of the JPEG or PNG the build would store
otherwise: through the same decoder, a pixel record and its JPEG twin give the same
image, and a PNG's pixels are its own (docs/FORMAT.md)."""

from __future__ import annotations

import cv2
import numpy as np

from ingest.images.normalize import Converted, Reject

_FLAGS = {1: cv2.IMREAD_GRAYSCALE, 3: cv2.IMREAD_COLOR_RGB}


def to_pixels(conv: Converted) -> Converted:
    """``conv`` (a JPEG or PNG payload) decoded into a pixel payload.

    Raises:
        Reject: it does not decode to its size (run inside ``cstderr.captured``: a
            decoder's warning is the caller's to judge).
    """
    flags = _FLAGS.get(conv.channels)
    img = None
    if flags is not None:
        img = cv2.imdecode(
            np.frombuffer(conv.payload, np.uint8), flags | cv2.IMREAD_IGNORE_ORIENTATION
        )
    if img is None or img.shape[:2] != (conv.height, conv.width):
        raise Reject(f"could not decode the {conv.format} into {conv.width}x{conv.height} pixels")
    return Converted(
        np.ascontiguousarray(img).tobytes(), "raw", conv.source_format, conv.height, conv.width,
        conv.channels, fixes=[*conv.fixes, "raw-pixels"],
    )  # fmt: skip
