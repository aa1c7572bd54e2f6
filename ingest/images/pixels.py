"""Decoded pixels as ImageFolder's readers see them: PIL's EXIF orientation, every mode
made 8-bit gray or RGB (the fix named), and a resize to a longer side."""

from __future__ import annotations

import io

import cv2
import numpy as np
from PIL import Image


def open_unlimited(data: bytes) -> Image.Image:
    """``Image.open`` without PIL's own pixel limit (Options.max_pixels replaces it, with
    a reason that names the option); restored at once, for other users of PIL."""
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        return Image.open(io.BytesIO(data))
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def pil_orientation(img: Image.Image) -> int:
    """The EXIF orientation PIL's ``exif_transpose`` applies: 1..8, where the tag's value
    (the first of several) equals one (an integer, or a rational such as 6/1), else 1
    (text, 6/0: PIL rotates nothing)."""
    try:
        value = img.getexif().get(0x0112, 1)
    except Exception:  # EXIF data PIL cannot parse: it rotates nothing either
        return 1
    return int(value) if value in range(1, 9) else 1


def png_bit_depth(data: bytes) -> int:
    return data[24] if len(data) > 25 and data[12:16] == b"IHDR" else 0


def to_8bit(img: Image.Image, fixes: list[str]) -> np.ndarray:
    """Pixels as uint8 HxW (gray) or HxWx3 (RGB), converting as ImageFolder would see them."""
    mode = img.mode
    if mode in ("L", "RGB"):
        return np.asarray(img)
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        fixes.append("16bit-to-8bit")
        wide = np.asarray(img, dtype=np.uint32 if mode == "I" else np.uint16)
        return np.clip((wide.astype(np.float64) / 257.0).round(), 0, 255).astype(np.uint8)
    if mode in ("1", "F"):
        fixes.append(f"mode-{mode}-to-gray")
        return np.asarray(img.convert("L"))
    if mode == "LA":
        fixes.append("alpha-dropped")
        return np.asarray(img.convert("L"))
    fixes.append(
        {"CMYK": "cmyk-to-rgb", "P": "palette-to-rgb", "PA": "palette-to-rgb"}.get(
            mode, "alpha-dropped" if "A" in mode else f"mode-{mode}-to-rgb"
        )
    )
    if mode == "P" and "transparency" in img.info:
        fixes.append("alpha-dropped")
        img = img.convert("RGBA")
    return np.asarray(img.convert("RGB"))


def channels(arr: np.ndarray) -> int:
    return 1 if arr.ndim == 2 else arr.shape[2]


def resize(arr: np.ndarray, max_size: int) -> np.ndarray:
    h, w = arr.shape[:2]
    scale = max_size / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return cv2.resize(arr, size, interpolation=cv2.INTER_AREA)


def bgr(arr: np.ndarray) -> np.ndarray:
    return arr if arr.ndim == 2 else np.ascontiguousarray(arr[:, :, ::-1])
