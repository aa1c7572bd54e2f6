"""A recipe's steps on one decoded image in a worker: OpenCV's ops (``image_ops``) where a
step has them, the step's own torch ops on a view of the image where it has not.

torchvision's RandAugment, TrivialAugmentWide and AutoAugment run here whole with nearest
warps, or bilinear ones without a fill; any other step (timm's ops, ColorJitter, bicubic)
runs its batched torch code on the one image, as before. Either way the pixels are the torch
ops' (``image_ops`` says within what).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from loader.cpu import image_ops as ops
from loader.ops.autoaugment import OPS, AutoAugment, RandAugment, TrivialAugmentWide
from loader.ops.autoaugment_batch import WARPS, matrices
from loader.ops.geometry import turns

_POLICIES = (RandAugment, TrivialAugmentWide, AutoAugment)
_TONE = {  # name -> (image, signed magnitude) -> image, as ``autoaugment._RUN``
    "Identity": lambda img, m: img,
    "Brightness": lambda img, m: ops.brightness(img, 1.0 + m),
    "Color": lambda img, m: ops.saturation(img, 1.0 + m),
    "Contrast": lambda img, m: ops.contrast(img, 1.0 + m),
    "Sharpness": lambda img, m: ops.sharpness(img, 1.0 + m),
    "Posterize": lambda img, m: ops.pointwise(img, "Posterize", m),
    "Solarize": lambda img, m: ops.pointwise(img, "Solarize", 255.0 * m),
    "Invert": lambda img, m: ops.pointwise(img, "Invert", 0.0),
    "AutoContrast": lambda img, m: ops.autocontrast(img),
    "Equalize": lambda img, m: ops.equalize(img),
}


def runs_here(step) -> bool:
    """Whether ``step`` runs on OpenCV's ops here rather than its torch ops."""
    return isinstance(step, _POLICIES) and ops.handles(step.interpolation, step.fill)


@functools.lru_cache(maxsize=1024)
def _matrix(name: str, m: float, h: int, w: int) -> np.ndarray:
    return matrices(name, np.array([m]), h, w)[0]  # the bins' few magnitudes recur


@functools.lru_cache(maxsize=1024)
def _turns(m: float, h: int, w: int) -> int:
    return int(turns(np.array([m]), h, w)[0])


def _policy(step, img: np.ndarray, row: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    cols = step.values(row[None], h, w)[0]
    for code, m in cols.reshape(-1, 2).tolist():
        if code < 0:
            continue
        name = OPS[int(code)]
        if name not in WARPS:
            img = _TONE[name](img, m)
        elif name == "Rotate" and (k := _turns(m, h, w)) >= 0:
            img = ops.turn(img, k)
        else:
            img = ops.warp(img, _matrix(name, m, h, w), step.interpolation, step.fill)
    return img


def _torch(step, img: np.ndarray, row: np.ndarray) -> np.ndarray:
    out = step.apply(torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0), row[None])
    return out[0].permute(1, 2, 0).numpy()


def apply(steps, image: np.ndarray, rows: list[np.ndarray]) -> None:
    """Run ``steps`` on ``image`` (uint8 HWC, written in place), each with its parameter
    ``row``."""
    img = image
    for step, row in zip(steps, rows, strict=True):
        img = (_policy if runs_here(step) else _torch)(step, img, row)
    if img is not image:
        image[...] = img
