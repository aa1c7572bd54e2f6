"""torchvision's auto-augment ops several at once on a batch (``autoaugment``'s groups):
every warp of a layer in one ``warp``, every LUT op in one lookup, the same pixels as op
by op."""

from __future__ import annotations

import numpy as np
import torch

from loader.ops import tone
from loader.ops.geometry import inverse_matrices, rotate, turns, warp
from loader.ops.layers import on_rows
from loader.ops.upload import on_device

WARPS = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
LUTS = ("Brightness", "Posterize", "Solarize", "Invert", "Equalize")


def matrices(name: str, m: np.ndarray, h: int, w: int) -> np.ndarray:
    """The centred inverse matrices of ``autoaugment``'s warps ``name`` at magnitudes ``m``."""
    if name == "Rotate":
        return inverse_matrices(angle=-np.mod(m, 360.0))
    if name.startswith("Shear"):
        degrees = np.degrees(np.arctan(m))
        zero = np.zeros_like(degrees)
        shear = (degrees, zero) if name == "ShearX" else (zero, degrees)
        return inverse_matrices(shear=shear, center=(-0.5 * w, -0.5 * h))
    t, zero = np.trunc(m), np.zeros_like(m)
    return inverse_matrices(translate=(t, zero) if name == "TranslateX" else (zero, t))


def warps(x, names: np.ndarray, m: np.ndarray, mode: str, fill) -> torch.Tensor:
    """Samples through the warps ``names``, one ``warp`` for them all (exact right-angle
    turns as ``rotate`` takes them)."""
    h, w = x.shape[-2:]
    exact = (names == "Rotate") & (turns(m, h, w) >= 0)
    inverse = np.zeros((len(x), 6))
    for name in np.unique(names):
        at = np.flatnonzero(names == name)
        inverse[at] = matrices(str(name), m[at], h, w)
    general = np.flatnonzero(~exact)
    if len(general):
        x = on_rows(x, general, lambda s: warp(s, inverse[general], mode, fill))
    rows = np.flatnonzero(exact)
    return on_rows(x, rows, lambda s: rotate(s, m[rows], mode, fill)) if len(rows) else x


def lookups(x, names: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """Samples through the LUT ops ``names``: the pointwise ones' LUTs made on the host with
    the float32 arithmetic of their tensor ops, Equalize's from its samples; one lookup."""
    n, c = x.shape[:2]
    # the arguments of the tensor ops: color.brightness blends by 1 + m (with 0, as PIL's),
    # solarize compares with 255 * m in float32
    args = np.where(names == "Brightness", 1.0 + m, np.where(names == "Solarize", 255.0 * m, m))
    luts = on_device(np.repeat(tone.host_luts(names, args)[:, None, :], c, 1), x.device)
    rows = np.flatnonzero(names == "Equalize")
    if len(rows):
        at = on_device(rows, x.device)
        luts.index_copy_(0, at, tone.equalize_lut(x.index_select(0, at)).view(-1, c, 256))
    return tone.lookup(x, luts.view(n * c, 256))
