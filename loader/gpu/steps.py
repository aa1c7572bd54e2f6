"""BatchSteps: a recipe's steps beyond the crop, run on the GPU path's finished batch.

Where the recipe has any (``Transform.steps``: ColorJitter, RandomGrayscale;
``Transform.erasing``), the stage crops into uint8 instead of normalising in its kernels;
then each step acts on the whole batch on the device (``loader.ops``; timm's policies
fused, ``loader.gpu.fused_layers``), and the batch is normalised, cast, erased (the recipe's
RandomErasing) and laid out in one launch (``loader.gpu.normalise``), all on the stage's
side stream. The draws come from the batch's seed (``loader.ops.draws``), so a resumed epoch
repeats them, and the CPU path makes the same.
"""

from __future__ import annotations

import numpy as np
import torch

from loader.augment import Transform
from loader.gpu import fused_layers
from loader.gpu.normalise import levels, normalise_erase
from loader.ops.draws import draw


class BatchSteps:
    """The steps of ``spec`` for a batch of ``dtype`` in ``memory_format``."""

    # The last launch (``loader.gpu.normalise``): None, on CUDA and not on the CPU (where
    # Triton's interpreter would run it: tests); True or False, always or never.
    fused: bool | None = None

    def __init__(self, spec: Transform, dtype: torch.dtype, memory_format) -> None:
        self.spec, self.steps, self.erasing = spec, spec.steps, spec.erasing
        self.dtype, self.format = dtype, memory_format
        if self.erasing is not None and not dtype.is_floating_point:
            raise ValueError(
                f"the recipe's RandomErasing erases normalised pixels, but dtype={dtype}; "
                "pass a float dtype (e.g. torch.float16)"
            )
        std = np.asarray(spec.std, dtype=np.float64)
        self._scale = (1.0 / (255.0 * std)).tolist()
        self._bias = (-np.asarray(spec.mean, dtype=np.float64) / std).tolist()
        self._affine: tuple | None = None  # (device, scale, bias, levels)

    @property
    def active(self) -> bool:
        return bool(self.steps) or self.erasing is not None

    def __call__(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """The batch ``x`` (uint8 [N, 3, H, W]) of batch seed ``seed``, stepped, normalised
        and cast; a new tensor."""
        draws = draw(self.spec, seed, len(x))
        for step, params in zip(self.steps, draws.params, strict=True):
            if x.is_cuda and fused_layers.handles(step, x):  # the same pixels, far fewer launches
                x = fused_layers.apply(step, x, params)
            else:
                x = step.apply(x, params)
        if self.dtype.is_floating_point and (x.is_cuda if self.fused is None else self.fused):
            return normalise_erase(  # the rest in one launch
                x, self._on(x.device)[2], self.dtype, self.format, self.erasing, draws.boxes,
                draws.noise,
            )  # fmt: skip
        if self.dtype.is_floating_point:
            scale, bias, _ = self._on(x.device)
            x = torch.addcmul(bias, x.float(), scale).to(self.dtype)
        if self.erasing is not None:
            x = self.erasing.apply(x, draws.boxes, seed=draws.noise)
        return x.contiguous(memory_format=self.format)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, bias, the levels' values) on ``device``, made once (from lists each
        batch they would synchronise the stream)."""
        if self._affine is None or self._affine[0] != device:
            scale = torch.tensor(self._scale, device=device).view(1, 3, 1, 1)
            bias = torch.tensor(self._bias, device=device).view(1, 3, 1, 1)
            self._affine = (device, scale, bias, levels(scale, bias))
        return self._affine[1:]
