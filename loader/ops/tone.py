"""Batched tone ops of the auto-augmentation policies on uint8 images [N, C, H, W].

Per-sample arguments are tensors of one value a sample. torchvision's tensor functions are
the reference of ``sharpness``, ``posterize``, ``solarize``, ``autocontrast``, ``equalize``
and ``invert`` (``equalize`` is also PIL's: the same LUT rule); brightness, saturation and
contrast are ``loader.ops.color``'s. The ``pil_`` ops are PIL's, as timm runs them:
``ImageEnhance`` blends ``degenerate + f * (image - degenerate)`` truncated, against PIL's
rounded integer luma (Contrast: its mean, rounded; Sharpness: the SMOOTH filter, which is
torchvision's rounded 3x3 blur, borders kept), and ``ImageOps.autocontrast``'s float64 LUT.
Histograms and LUTs are batched (``scatter_add``, ``cumsum``, ``gather``): no loop over images.
"""

from __future__ import annotations

import numpy as np
import torch


def _per_sample(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def smooth(img: torch.Tensor) -> torch.Tensor:
    """The blur [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 of float ``img``, rounded, its border
    pixels kept (a new float tensor): torchvision's, and PIL's SMOOTH filter. Summed exactly
    in float32 (3x3 box + 4 x centre) and divided once: the rounding is a convolution's (a
    sum / 13 is never within float error of a half), at a fraction of a depthwise conv."""
    out = img.clone()
    if img.shape[-2] > 2 and img.shape[-1] > 2:
        rows = img[..., :, :-2] + img[..., :, 1:-1] + img[..., :, 2:]
        box = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]
        centre = out[..., 1:-1, 1:-1]
        centre.copy_(box.add_(centre, alpha=4.0).div_(13.0).round_())
    return out


def sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_sharpness``: ``x + (1 - factor) * (smooth(x) - x)``."""
    img = x.float()
    step = smooth(img).sub_(img).mul_(_per_sample(1.0 - factor))
    return img.add_(step).clamp_(0, 255).to(torch.uint8)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Keep the ``bits`` high bits of each sample (0: black, 8 or more: unchanged)."""
    mask = (255 << (8 - bits.long().clamp(0, 8))) & 255
    return x & _per_sample(mask.to(torch.uint8))


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Invert the pixels ``>= threshold`` (compared in the threshold's dtype)."""
    return x ^ (x >= _per_sample(threshold)).to(torch.uint8).mul_(255)  # (uint8 where: slow)


def solarize_add(x: torch.Tensor, add: torch.Tensor, threshold: int = 128) -> torch.Tensor:
    """timm's ``solarize_add``: ``add`` to the pixels below ``threshold``, capped at 255."""
    added = (x.to(torch.int16) + _per_sample(add.to(torch.int16))).clamp_(max=255)
    return x + (x < threshold).to(torch.uint8).mul_(added.to(torch.uint8) - x)


def invert(x: torch.Tensor) -> torch.Tensor:
    return x.bitwise_not()


def host_luts(kinds: np.ndarray, args: np.ndarray) -> np.ndarray:
    """The LUTs [n, 256] uint8 of the pointwise ops ``kinds`` with their ``args``: "Invert",
    "Posterize" (bits), "Solarize" (threshold), "SolarizeAdd" (added below 128),
    "Brightness" (factor; PIL's and torchvision's blend with 0), any other the identity;
    made on the host in the float32 arithmetic of the ops above, so that a batch's
    pointwise ops are one lookup on the device with the same pixels."""
    levels = np.arange(256, dtype=np.int64)[None, :]
    kind, a = np.asarray(kinds)[:, None], np.nan_to_num(np.asarray(args, np.float64))[:, None]
    out = np.where(kind == "Invert", 255 - levels, levels)
    bits = np.clip(a.astype(np.int64), 0, 8)
    out = np.where(kind == "Posterize", levels & ((255 << (8 - bits)) & 255), out)
    threshold = a.astype(np.float32)
    out = np.where((kind == "Solarize") & (levels >= threshold), 255 - levels, out)
    added = np.minimum(levels + a.astype(np.int64), 255)
    out = np.where((kind == "SolarizeAdd") & (levels < 128), added, out)
    blended = (levels.astype(np.float32) * a.astype(np.float32)).clip(0, 255).astype(np.int64)
    return np.where(kind == "Brightness", blended, out).astype(np.uint8)


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """torchvision's: each channel stretched to 0..255 (``(x - min) / ((max - min) / 255)``,
    truncated; a flat channel kept)."""
    low = x.amin((-2, -1), keepdim=True).float()
    high = x.amax((-2, -1), keepdim=True).float()
    flat = high == low
    inv_scale = (high - low).mul_(1.0 / 255.0).masked_fill_(flat, 1.0)
    low = low.masked_fill_(flat, 0.0)
    return x.float().sub_(low).div_(inv_scale).clamp_(0, 255).to(torch.uint8)


def lookup(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """``x`` through a uint8 LUT per sample and channel ([N * C, 256])."""
    n, c, h, w = x.shape
    return lut.gather(1, x.reshape(n * c, h * w).long()).view(n, c, h, w)


def autocontrast_pil(x: torch.Tensor) -> torch.Tensor:
    """PIL's ``ImageOps.autocontrast``: the LUT ``int(i * scale - low * scale)`` (float64)."""
    return lookup(x, autocontrast_pil_lut(x))


def autocontrast_pil_lut(x: torch.Tensor) -> torch.Tensor:
    """``autocontrast_pil``'s LUT of each sample and channel, uint8 [N * C, 256]."""
    n, c = x.shape[:2]
    low = x.amin((-2, -1)).reshape(n * c, 1).double()
    high = x.amax((-2, -1)).reshape(n * c, 1).double()
    scale = torch.full_like(high, 255.0).div_((high - low).clamp_(min=1.0))  # not 1/x * 255
    levels = torch.arange(256, dtype=torch.float64, device=x.device)
    lut = (levels * scale + (-low * scale)).trunc_().clamp_(0, 255)
    return torch.where(high > low, lut, levels).to(torch.uint8)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """torchvision's (and PIL's) ``equalize``: per channel, the LUT
    ``(cumsum[i - 1] + step // 2) // step``, ``step`` the pixels below the top level // 255;
    a channel with ``step == 0`` kept."""
    return lookup(x, equalize_lut(x))


def equalize_lut(x: torch.Tensor) -> torch.Tensor:
    """``equalize``'s LUT of each sample and channel, uint8 [N * C, 256]."""
    n, c, h, w = x.shape
    flat = x.reshape(n * c, h * w).long()
    hist = torch.zeros((n * c, 256), dtype=torch.int32, device=x.device)
    hist.scatter_add_(1, flat, torch.ones((), dtype=torch.int32, device=x.device).expand_as(flat))
    cum = hist.cumsum(1)
    top = hist.gather(1, cum.argmax(1, keepdim=True))  # the count of the top level
    step = (h * w - top).div_(255, rounding_mode="floor")
    lut = cum[:, :-1].add_(step // 2).div_(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    lut = torch.cat([torch.zeros_like(lut[:, :1]), lut], 1)
    return torch.where(step > 0, lut, torch.arange(256, device=x.device)).to(torch.uint8)


def pil_gray(x: torch.Tensor) -> torch.Tensor:
    """PIL's ``convert("L")``: the rounded ITU-R 601-2 luma in 16-bit fixed point, int32
    [N, 1, H, W]."""
    r, g, b = x.to(torch.int32).unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 32768) >> 16).unsqueeze(1)


def pil_blend(degenerate, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.blend(degenerate, x, factor)``: ``d + f * (x - d)`` in float32,
    clipped and truncated (``ImageEnhance``'s ``enhance``)."""
    out = x.float().sub_(degenerate).mul_(_per_sample(factor.float())).add_(degenerate)
    return out.clamp_(0, 255).to(torch.uint8)


def pil_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return pil_blend(0.0, x, factor)


def pil_color(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return pil_blend(pil_gray(x).float(), x, factor)


def pil_contrast(x: torch.Tensor, factor: torch.Tensor, mean=None) -> torch.Tensor:
    """Blended with the mean luma, rounded (``int(mean + 0.5)``, in integers here), that of
    ``x`` or the ``mean`` given (a tensor of one a sample)."""
    mean = pil_mean(x) if mean is None else mean
    return pil_blend(_per_sample(mean.float()), x, factor)


def pil_mean(x: torch.Tensor) -> torch.Tensor:
    """Each sample's mean luma, rounded as PIL's ``ImageEnhance.Contrast`` (int64 [N])."""
    total = pil_gray(x).sum((1, 2, 3), dtype=torch.int64)
    count = x.shape[-2] * x.shape[-1]
    return (2 * total + count).div_(2 * count, rounding_mode="floor")


def pil_sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return pil_blend(smooth(x.float()), x, factor)
