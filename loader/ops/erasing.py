"""RandomErasing on a normalised float batch [N, 3, H, W]: one box a sample, per-sample draws.

The box is drawn as torchvision's ``RandomErasing.get_params`` and timm's
``RandomErasing`` (count 1) both draw it: an area share uniform in ``scale``, a log-uniform
aspect ratio, up to 10 tries for a box smaller than the image, then a uniform position;
no box where every try fails. It is filled with a constant (torchvision's ``value``,
timm's ``const``), normal noise per channel (timm's ``rand``) or per pixel (torchvision's
``"random"``, timm's ``pixel``), the same values on every path (``loader.ops.noise``).
One masked write a batch on a GPU; on the CPU a write per box, the noise made only where
it goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loader.ops import noise
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
        width), height 0 where a sample is left as it is. Every try of every sample is
        drawn at once and each takes its first that fits: the distribution of one try
        after another, without a Python loop over the batch."""
        h_img, w_img = size
        boxes = np.zeros((n, 4), dtype=np.int64)
        chosen = np.flatnonzero(rng.random(n) < self.p)
        tries = (len(chosen), _TRIES)
        area = h_img * w_img * rng.uniform(*self.scale, size=tries)
        aspect = np.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1]), tries))
        h = np.round(np.sqrt(area * aspect)).astype(np.int64)  # half to even, as round()
        w = np.round(np.sqrt(area / aspect)).astype(np.int64)
        fits = (h < h_img) & (w < w_img)
        hit = fits.any(axis=1)
        first = fits.argmax(axis=1)[hit]
        h, w = h[hit, first], w[hit, first]
        top, left = rng.integers(0, h_img - h + 1), rng.integers(0, w_img - w + 1)
        boxes[chosen[hit]] = np.stack([top, left, h, w], axis=1)
        return boxes

    def apply(
        self, x: torch.Tensor, boxes: np.ndarray, seed: int = 0, by_box: bool | None = None
    ) -> torch.Tensor:
        """``x`` with each sample's box filled, the noise ``loader.ops.noise``'s of ``seed``
        (the same values whether the batch is filled at once or box by box). ``by_box``:
        box by box (the default on the CPU) or the whole batch in one masked write."""
        if not boxes[:, 2].any():
            return x
        if x.device.type == "cpu" if by_box is None else by_box:
            return self._each_box(x, boxes, seed)
        dev = x.device
        rows = np.flatnonzero(boxes[:, 2])
        at = on_device(rows, dev)
        b = on_device(boxes[rows], dev)
        h_img, w_img = x.shape[2:]
        ys = torch.arange(h_img, device=dev)
        xs = torch.arange(w_img, device=dev)
        top, left, h, w = (b[:, k].view(-1, 1, 1) for k in range(4))
        inside = (ys.view(1, -1, 1) >= top) & (ys.view(1, -1, 1) < top + h)
        inside = (inside & (xs.view(1, 1, -1) >= left) & (xs.view(1, 1, -1) < left + w))[:, None]
        if self.fill == "const":
            fill = constant(tuple(self.value), dev, x.dtype).view(1, 3, 1, 1)
        else:
            key = on_device(noise.keys(seed, rows), dev)
            if self.fill == "channel":
                zero = torch.zeros(1, dtype=torch.int64, device=dev)
                fill = noise.normal(key, 3, zero, zero, (1, 1))
            else:
                fill = noise.normal(key, 3, ys, xs, (h_img, w_img))
            fill = fill.to(x.dtype)
        erased = torch.where(inside, fill, x.index_select(0, at))
        return x.index_copy(0, at, erased)

    def _each_box(self, x: torch.Tensor, boxes: np.ndarray, seed: int) -> torch.Tensor:
        """Box by box (noise only where it goes), a new tensor."""
        x = x.clone()
        const = torch.tensor(self.value, dtype=x.dtype, device=x.device).view(3, 1, 1)
        zero = torch.zeros(1, dtype=torch.int64, device=x.device)
        rows = np.flatnonzero(boxes[:, 2])
        keys = torch.from_numpy(noise.keys(seed, rows)).to(x.device)
        h_img, w_img = x.shape[2:]
        for key, k in zip(keys, rows, strict=True):
            top, left, h, w = (int(v) for v in boxes[k])
            box = x[k, :, top : top + h, left : left + w]
            if self.fill == "const":
                box.copy_(const.expand_as(box))
            elif self.fill == "channel":
                box.copy_(noise.normal(key.view(1), 3, zero, zero, (1, 1))[0].expand(3, h, w))
            else:
                ys = torch.arange(top, top + h, device=x.device)
                xs = torch.arange(left, left + w, device=x.device)
                box.copy_(noise.normal(key.view(1), 3, ys, xs, (h_img, w_img))[0])
        return x
