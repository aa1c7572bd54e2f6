"""RandomErasing on a normalised float batch [N, 3, H, W]: one box a sample, per-sample draws.

The box is drawn as torchvision's ``RandomErasing.get_params`` and timm's
``RandomErasing`` (count 1) both draw it: an area share uniform in ``scale``, a log-uniform
aspect ratio, up to 10 tries for a box smaller than the image, then a uniform position;
no box where every try fails. It is filled with a constant (torchvision's ``value``,
timm's ``const``), normal noise per channel (timm's ``rand``) or per pixel (torchvision's
``"random"``, timm's ``pixel``). One masked write a batch on a GPU; on the CPU a write
per box, the noise drawn only where it goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loader.ops.upload import constant, on_device

FILLS = ("const", "channel", "pixel")
_TRIES = 10


@dataclass(frozen=True)
class RandomErasing:
    """Erase a box of each sample with probability ``p`` (see the module docstring)."""

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    fill: str = "const"
    value: tuple[float, float, float] = (0.0, 0.0, 0.0)  # const: per channel

    def __post_init__(self) -> None:
        if self.fill not in FILLS:
            raise ValueError(f"fill={self.fill!r} is unknown; known: {', '.join(FILLS)}")

    def draw(self, rng: np.random.Generator, n: int, size: tuple[int, int]) -> np.ndarray:
        """Boxes of ``n`` samples of ``size`` (H, W): int64 [n, 4] (top, left, height,
        width), height 0 where a sample is left as it is."""
        h_img, w_img = size
        boxes = np.zeros((n, 4), dtype=np.int64)
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for k in np.flatnonzero(rng.random(n) < self.p):
            for _ in range(_TRIES):
                area = h_img * w_img * rng.uniform(*self.scale)
                aspect = math.exp(rng.uniform(*log_ratio))
                h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
                if h < h_img and w < w_img:
                    top, left = rng.integers(0, h_img - h + 1), rng.integers(0, w_img - w + 1)
                    boxes[k] = (top, left, h, w)
                    break
        return boxes

    def apply(self, x: torch.Tensor, boxes: np.ndarray, seed: int = 0) -> torch.Tensor:
        """``x`` with each sample's box filled (noise drawn from ``seed`` on ``x``'s device)."""
        if not boxes[:, 2].any():
            return x
        if x.device.type == "cpu":
            return self._each_box(x, boxes, seed)
        dev = x.device
        b = on_device(boxes, dev)
        rows = torch.arange(x.shape[2], device=dev).view(1, -1, 1)
        cols = torch.arange(x.shape[3], device=dev).view(1, 1, -1)
        top, left, h, w = (b[:, k].view(-1, 1, 1) for k in range(4))
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        inside = inside.unsqueeze(1)  # [N, 1, H, W]
        if self.fill == "const":
            fill = constant(tuple(self.value), dev, x.dtype).view(1, 3, 1, 1)
        else:
            gen = torch.Generator(device=dev).manual_seed(int(seed))
            shape = (x.shape[0], 3, 1, 1) if self.fill == "channel" else tuple(x.shape)
            fill = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32)
            fill = fill.to(x.dtype)
        return torch.where(inside, fill, x)

    def _each_box(self, x: torch.Tensor, boxes: np.ndarray, seed: int) -> torch.Tensor:
        """On the CPU: fill box by box (noise only where it goes), a new tensor."""
        x = x.clone()
        gen = torch.Generator().manual_seed(int(seed))
        const = torch.tensor(self.value, dtype=x.dtype).view(3, 1, 1)
        for k in np.flatnonzero(boxes[:, 2]):
            top, left, h, w = (int(v) for v in boxes[k])
            box = x[k, :, top : top + h, left : left + w]
            if self.fill == "const":
                box.copy_(const.expand_as(box))
            else:
                shape = (3, 1, 1) if self.fill == "channel" else (3, h, w)
                box.copy_(torch.randn(shape, generator=gen).expand(3, h, w))
        return x
