"""Mixup and CutMix of a delivered batch, with timm's semantics (``timm.data.Mixup``).

Each batch is mixed with itself reversed. With probability ``prob``: where both alphas
are set, CutMix with probability ``switch_prob``, else Mixup; lambda from Beta(alpha,
alpha). Mixup blends the images; CutMix pastes a box of ``sqrt(1 - lambda)`` of the
height and width at a uniform centre, clipped to the image, and (``correct_lam``) takes
lambda as the share left uncovered. Targets become one-hot with label smoothing, mixed by
the same lambda. ``mode="batch"`` draws once a batch, ``"elem"`` once a sample. Draws come
from ``seed`` (numpy), so a resumed run that passes the same seed and batch count mixes
alike. It acts on whole batches, after the loader, on the batch's device.
"""

from __future__ import annotations

import numpy as np
import torch

from loader.ops.upload import on_device

MODES = ("batch", "elem")


class Mixup:
    """``mixup, targets = Mixup(...)(images, labels)``; see the module docstring.

    Args:
        mixup_alpha, cutmix_alpha: Beta parameters (0 turns that one off).
        prob: probability that a batch (or sample) is mixed at all.
        switch_prob: with both on, the probability of CutMix rather than Mixup.
        mode: "batch" or "elem".
        correct_lam: CutMix's lambda from the clipped box's area.
        label_smoothing: spread over ``num_classes``, as timm's ``mixup_target``.
        num_classes: the targets' width.
        seed: the draws' seed (None: fresh entropy).
    """

    def __init__(
        self,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: str = "batch",
        correct_lam: bool = True,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        seed: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; known: {', '.join(MODES)}")
        if mixup_alpha < 0 or cutmix_alpha < 0:
            raise ValueError("mixup_alpha and cutmix_alpha must be >= 0 (0: off)")
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes!r}: pass the number of classes")
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.prob, self.switch_prob, self.mode = float(prob), float(switch_prob), mode
        self.correct_lam, self.smoothing = bool(correct_lam), float(label_smoothing)
        self.num_classes = int(num_classes)
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(lambda, CutMix or not) of each of ``n`` samples (all alike in "batch" mode)."""
        k = 1 if self.mode == "batch" else n
        lam, cut = np.ones(k), np.zeros(k, dtype=bool)
        mixed = self.rng.random(k) < self.prob
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = self.rng.random(k) < self.switch_prob
        elif self.cutmix_alpha > 0:
            cut[:] = True
        elif not self.mixup_alpha > 0:
            mixed[:] = False
        for i in np.flatnonzero(mixed):
            alpha = self.cutmix_alpha if cut[i] else self.mixup_alpha
            lam[i] = self.rng.beta(alpha, alpha)
        cut &= mixed
        return np.broadcast_to(lam, (n,)).copy(), np.broadcast_to(cut, (n,)).copy()

    def boxes(self, lam: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """CutMix boxes for ``lam`` ([n, 4]: y0, y1, x0, x1) and the lambdas they give."""
        h, w = size
        ratio = np.sqrt(1.0 - lam)
        cut_h, cut_w = (h * ratio).astype(np.int64), (w * ratio).astype(np.int64)
        k = 1 if self.mode == "batch" else len(lam)
        cy = np.broadcast_to(self.rng.integers(0, h, k), lam.shape)
        cx = np.broadcast_to(self.rng.integers(0, w, k), lam.shape)
        y0, y1 = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + cut_h // 2, 0, h)
        x0, x1 = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + cut_w // 2, 0, w)
        if self.correct_lam:
            lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)
        return np.stack([y0, y1, x0, x1], 1), lam

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple:
        """(the mixed images, a new float tensor; float targets [N, num_classes]);
        ``images``: [N, C, H, W] of any memory format."""
        lam, cut = self.draw(len(images))
        boxes, cut_lam = self.boxes(lam, tuple(images.shape[-2:]))
        lam = np.where(cut, cut_lam, lam)
        dev = images.device
        other = images.flip(0)
        weight = on_device(np.where(cut, 1.0, lam), dev, images.dtype).view(-1, 1, 1, 1)
        out = images * weight + other * (1 - weight)  # Mixup's blend (1: CutMix's rows)
        if cut.any():
            b = on_device(np.where(cut[:, None], boxes, 0), dev)
            rows = torch.arange(images.shape[-2], device=dev).view(1, -1, 1)
            cols = torch.arange(images.shape[-1], device=dev).view(1, 1, -1)
            y0, y1, x0, x1 = (b[:, k].view(-1, 1, 1) for k in range(4))
            inside = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)).unsqueeze(1)
            out = torch.where(inside, other, out)
        return out, self.targets(labels, on_device(lam, labels.device))

    def targets(self, labels: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """timm's ``mixup_target``: smoothed one-hot targets mixed with the reversed
        batch's by ``lam`` (per sample)."""
        off = self.smoothing / self.num_classes
        on = 1.0 - self.smoothing + off
        hot = torch.full((len(labels), self.num_classes), off, device=labels.device)
        hot.scatter_(1, labels.long().view(-1, 1), on)
        lam = lam.to(hot.dtype).view(-1, 1)
        return hot * lam + hot.flip(0) * (1.0 - lam)
