"""ColorJitter and RandomGrayscale on a uint8 batch [N, 3, H, W], per-sample parameters.

torchvision's tensor functions are the reference (``adjust_brightness``, ``_contrast``,
``_saturation``, ``_hue``, ``rgb_to_grayscale``): the same blends, the same truncation to
uint8 and the same HSV rotation, written for a batch with one factor per sample, so a
batch costs a few kernels per step and no Python per image. Like torchvision's
``ColorJitter``, each sample takes the four steps in an order of its own. Parameters come
from a numpy ``Generator`` (the loader's per-batch seed), not from torch's global RNG:
the same seed gives the same draws on every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import torch

from loader.ops.upload import constant, on_device

GRAY = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale

# Which of (v, q, p, t) each channel takes, by hue sextant (the HSV -> RGB conversion).
_SEXTANTS = ((0, 3, 2), (1, 0, 2), (2, 0, 3), (2, 1, 0), (3, 2, 0), (0, 2, 1))


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma of a uint8 batch, truncated to uint8 (as torchvision's), [N, 1, H, W]."""
    r, g, b = x.unbind(1)
    return (GRAY[0] * r + GRAY[1] * g + GRAY[2] * b).to(torch.uint8).unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``ratio * x + (1 - ratio) * other`` per sample, clamped and truncated to uint8."""
    r = ratio.view(-1, 1, 1, 1)
    return (r * x + (1.0 - r) * other).clamp_(0, 255).to(torch.uint8)


def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(x, torch.zeros((), device=x.device), factor)


def contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    mean = _gray(x).float().mean(dim=(1, 2, 3), keepdim=True)
    return _blend(x, mean, factor)


def saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(x, _gray(x), factor)


def hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate each sample's hue by ``shift`` (a fraction of the circle, -0.5..0.5) in HSV
    space (PIL's conversion, as torchvision uses); on the CPU with OpenCV's (the same
    within a level, 4x faster than torch's there)."""
    return _hue_opencv(x, shift) if x.device.type == "cpu" else hue_torch(x, shift)


def hue_torch(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``hue`` batched in torch: what a GPU runs."""
    f = x.float() / 255.0
    top, _ = f.max(1)
    low, _ = f.min(1)
    span = top - low
    flat = span == 0
    s = span / torch.where(flat, torch.ones_like(top), top)
    d = torch.where(flat, torch.ones_like(span), span)
    r, g, b = f.unbind(1)
    rc, gc, bc = (top - r) / d, (top - g) / d, (top - b) / d
    h = torch.where(top == r, bc - gc, torch.where(top == g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.fmod(h / 6.0 + 1.0, 1.0)
    h = torch.remainder(h + shift.view(-1, 1, 1), 1.0)
    # back to RGB: the sextant i and the three levels of each pixel
    i = torch.floor(h * 6.0)
    frac = h * 6.0 - i
    i = i.to(torch.int64) % 6
    p = (top * (1.0 - s)).clamp(0.0, 1.0)
    q = (top * (1.0 - s * frac)).clamp(0.0, 1.0)
    t = (top * (1.0 - s * (1.0 - frac))).clamp(0.0, 1.0)
    v = top
    levels = torch.stack([v, q, p, t], 1)  # which of them each channel takes, by sextant
    pick = constant(_SEXTANTS, x.device, torch.int64)[i]  # [N, H, W, 3]
    rgb = torch.gather(levels, 1, pick.permute(0, 3, 1, 2))
    return (rgb * (255.0 + 1.0 - 1e-3)).to(torch.uint8)  # torchvision's float -> uint8


def _hue_opencv(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.channels_last)
    for k, turn in enumerate(shift.tolist()):
        hsv = cv2.cvtColor(x[k].permute(1, 2, 0).numpy().astype(np.float32), cv2.COLOR_RGB2HSV)
        h = hsv[..., 0]  # degrees (the scale of S and V does not matter)
        h += turn * 360.0
        np.mod(h, 360.0, out=h)
        rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
        np.multiply(rgb, (255.0 + 1.0 - 1e-3) / 255.0, out=rgb)
        out[k].permute(1, 2, 0).numpy()[...] = rgb  # truncated, as torchvision's
    return out


def grayscale(x: torch.Tensor) -> torch.Tensor:
    return _gray(x).expand(-1, 3, -1, -1)


_STEPS = (brightness, contrast, saturation, hue)


@dataclass(frozen=True)
class ColorJitter:
    """torchvision's ``ColorJitter``: factors drawn uniformly from each range (brightness,
    contrast, saturation about 1; hue about 0), None where a step is off."""

    brightness: tuple[float, float] | None = None
    contrast: tuple[float, float] | None = None
    saturation: tuple[float, float] | None = None
    hue: tuple[float, float] | None = None

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Parameters of ``n`` samples: [n, 8] float64, the four steps' order (a
        permutation of 0..3, as torchvision draws one per call) then their factors (NaN
        where a step is off)."""
        order = np.argsort(rng.random((n, 4)), axis=1)
        factors = np.full((n, 4), np.nan)
        for k, bounds in enumerate((self.brightness, self.contrast, self.saturation, self.hue)):
            if bounds is not None:
                factors[:, k] = rng.uniform(bounds[0], bounds[1], n)
        return np.concatenate([order, factors], 1)

    def apply(self, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
        """``x`` (uint8 [N, 3, H, W]) with each sample's steps in its order."""
        order, factors = params[:, :4].astype(np.int64), params[:, 4:]
        for position in range(4):
            for step in range(4):
                rows = np.flatnonzero((order[:, position] == step) & ~np.isnan(factors[:, step]))
                if not len(rows):
                    continue
                at = on_device(rows, x.device)
                f = on_device(factors[rows, step], x.device, torch.float32)
                x = x.index_copy(0, at, _STEPS[step](x.index_select(0, at), f))
        return x


@dataclass(frozen=True)
class RandomGrayscale:
    """torchvision's ``RandomGrayscale(p)``: each sample made gray with probability ``p``."""

    p: float = 0.1

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return (rng.random(n) < self.p).astype(np.float64)[:, None]

    def apply(self, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
        rows = np.flatnonzero(params[:, 0] > 0)
        if not len(rows):
            return x
        at = on_device(rows, x.device)
        return x.index_copy(0, at, grayscale(x.index_select(0, at)).contiguous())
