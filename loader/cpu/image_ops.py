"""torchvision's auto-augment ops on one uint8 HWC image (numpy), with OpenCV: what the
workers run in place of ``loader.ops``'s batched torch ops.

A worker augments one decoded image at a time, where torch's per-call costs, its skinny
grid matmul and its float conversions outweigh the op itself (docs/design/augmentations.md
has the figures). The pixels are the torch ops': the pointwise ops are LUTs made in those
ops' float32 arithmetic, the blends take the same float32 steps, the blur is summed
exactly, a nearest warp gathers the very pixels the torch grid picks, and a bilinear one
is OpenCV's (within a level on about 1 pixel in 10^4; tested). Only the tensor edge rule
with nearest, or bilinear without a fill, is here (``handles``); the rest keep the torch
ops.
"""

from __future__ import annotations

import functools

import cv2
import numpy as np

from loader.ops import tone
from loader.ops.color import GRAY
from loader.ops.geometry import nearest_pixels

_LEVELS = np.arange(256, dtype=np.float32)
_ONE = np.float32(1.0)
_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32)


def lut(img: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``img`` through a uint8 LUT: [256] for every channel, or [3, 256] one each."""
    table = np.asarray(table, np.uint8)
    if table.ndim == 2:
        table = np.ascontiguousarray(table.T).reshape(1, 256, 3)
    return cv2.LUT(img, table)


def _truncate(v: np.ndarray) -> np.ndarray:
    return np.clip(v, 0, 255, out=v).astype(np.uint8)  # as torch's float -> uint8


def _planes(img: np.ndarray) -> list[np.ndarray]:
    return cv2.split(img)  # contiguous channels: numpy's reductions over HWC are slow


def gray(img: np.ndarray) -> np.ndarray:
    """``color._gray``: luma in float32 steps, truncated to uint8, [H, W]."""
    r, g, b = (p.astype(np.float32) for p in _planes(img))
    return _truncate(np.float32(GRAY[0]) * r + np.float32(GRAY[1]) * g + np.float32(GRAY[2]) * b)


def _blend_lut(factor: float, other) -> np.ndarray:
    """The LUT of ``color._blend`` with a constant ``other``: ``f * x + (1 - f) * other``."""
    f = np.float32(factor)
    return _truncate(f * _LEVELS + (_ONE - f) * np.float32(other))


def brightness(img: np.ndarray, factor: float) -> np.ndarray:
    return lut(img, _blend_lut(factor, 0.0))


def contrast(img: np.ndarray, factor: float) -> np.ndarray:
    """A blend with the luma's mean: a float32 sum of whole levels is exact up to 2^24, as
    the torch op's is (224 x 224 x 255 is under it)."""
    luma = gray(img)
    mean = np.float32(cv2.sumElems(luma)[0]) / np.float32(luma.size)
    return lut(img, _blend_lut(factor, mean))


def saturation(img: np.ndarray, factor: float) -> np.ndarray:
    f = np.float32(factor)
    luma = cv2.merge([gray(img)] * 3).astype(np.float32)  # numpy broadcasts over HWC slowly
    return _truncate(f * img.astype(np.float32) + (_ONE - f) * luma)


def sharpness(img: np.ndarray, factor: float) -> np.ndarray:
    """``tone.sharpness``: ``x + (1 - f) * (smooth(x) - x)``, the blur's sums exact in
    float32 and divided once; the border pixels kept."""
    if img.shape[0] < 3 or img.shape[1] < 3:
        return img.copy()
    x = img.astype(np.float32)
    smooth = np.rint(cv2.filter2D(x, -1, _SMOOTH) / np.float32(13.0))
    for edge in (np.s_[0], np.s_[-1], np.s_[:, 0], np.s_[:, -1]):
        smooth[edge] = x[edge]
    return _truncate(x + (smooth - x) * (_ONE - np.float32(factor)))


@functools.lru_cache(maxsize=512)
def _pointwise_lut(name: str, arg: float) -> np.ndarray:
    return tone.host_luts(np.array([name]), np.array([arg]))[0]


def pointwise(img: np.ndarray, name: str, arg: float) -> np.ndarray:
    """Posterize (bits), Solarize (threshold), Invert: ``tone.host_luts``' LUTs."""
    return lut(img, _pointwise_lut(name, float(arg)))


def autocontrast(img: np.ndarray) -> np.ndarray:
    """``tone.autocontrast`` as a LUT per channel, in its float32 steps."""
    extremes = np.array([cv2.minMaxLoc(p)[:2] for p in _planes(img)], np.float32)
    low, high = extremes[:, :1], extremes[:, 1:]
    flat = high == low
    inv_scale = np.where(flat, _ONE, (high - low) * np.float32(1.0 / 255.0))
    low = np.where(flat, np.float32(0.0), low)
    return lut(img, _truncate((_LEVELS[None] - low) / inv_scale))


def equalize(img: np.ndarray) -> np.ndarray:
    """``tone.equalize``: per channel ``(cumsum[i - 1] + step // 2) // step``."""
    tables = []
    for plane in _planes(img):
        hist = cv2.calcHist([plane], [0], None, [256], [0, 256]).reshape(-1).astype(np.int64)
        cum = np.cumsum(hist)
        step = (plane.size - hist[np.argmax(cum)]) // 255
        if step == 0:
            tables.append(np.arange(256))
            continue
        tables.append(np.clip(np.concatenate([[0], (cum[:-1] + step // 2) // step]), 0, 255))
    return lut(img, np.stack(tables))


@functools.lru_cache(maxsize=32)  # 200 KB at 224 x 224; a policy's magnitudes recur
def _nearest_map(matrix: tuple, h: int, w: int) -> np.ndarray:
    xs, ys = nearest_pixels(np.array(matrix), h, w)
    return cv2.convertMaps(xs, ys, cv2.CV_16SC2, nninterpolation=True)[0]


def warp(img: np.ndarray, matrix: np.ndarray, mode: str, fill) -> np.ndarray:
    """``geometry.warp``'s tensor rule: ``img`` through the centred inverse ``matrix``
    (pixel centres about the image centre), ``fill`` (rounded, clamped; None: zeros)
    outside. Nearest takes ``geometry.nearest_pixels`` (a tie, as a shear's nice
    magnitudes give on whole rows, rounds as torch's does); bilinear OpenCV's own."""
    h, w = img.shape[:2]
    value = (0.0,) * 3 if fill is None else tuple(float(np.clip(np.rint(v), 0, 255)) for v in fill)
    if mode == "nearest":
        pixels = _nearest_map(tuple(float(v) for v in matrix), h, w)
        return cv2.remap(img, pixels, None, cv2.INTER_NEAREST, borderValue=value)
    a, b, c, d, e, f = (float(v) for v in matrix)
    ox, oy = 0.5 * w - 0.5, 0.5 * h - 0.5  # index = centred + (w / 2 - 1 / 2)
    m = np.array([[a, b, c + ox - a * ox - b * oy], [d, e, f + oy - d * ox - e * oy]])
    return cv2.warpAffine(
        img, m, (w, h), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT, borderValue=value,
    )  # fmt: skip


def turn(img: np.ndarray, quarters: int) -> np.ndarray:
    """An exact counter-clockwise turn, as ``torch.rot90`` over (H, W)."""
    return np.ascontiguousarray(np.rot90(img, quarters, (0, 1)))


def handles(mode: str, fill) -> bool:
    """Whether ``warp`` makes the torch ops' pixels for ``mode`` and ``fill``: not bilinear
    with a fill, which torchvision weighs by the sampled mask twice (``mask * (out -
    fill) + fill``, ``out`` itself masked) where OpenCV blends it in once."""
    return mode == "nearest" or (mode == "bilinear" and fill is None)
